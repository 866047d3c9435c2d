"""One NeuronCore's device memory for a build (`core_bytes`), the one fit every plan and the build
gate (backends/neuron.py, before tracing) count by: weights in the dtype they load (int8 codes and
their scales under --quantize), the KV cache of its slots, each compiled graph's own bytes, the MoE
working set, the weight-layout transform and a runtime reserve.

A graph's bytes are its inputs + outputs (held to the graphs themselves: plan/traced_io.py,
tests/unit/test_fit_io.py) and an allowance for its binary (instructions, scratch), summed over a
build's graphs (port/device_plan.graph_kinds) with the MoE working set of its largest call
(port/device_plan.moe_working_set_bytes). Every (length, KV bucket) is its own NEFF with its own
instructions and I/O buffers (inputs, logits, captures). The constants are labelled: each is
replaced by the first inf2 run's measurements (harness/plan/calibration.py) where they exist.
"""

from __future__ import annotations

from harness.base.settings import DEFAULT_BUCKETS
from harness.inputs.quantize import quantized_weight_bytes
from harness.inputs.spec import ModelSpec
from harness.port.device_plan import MAX_KV_BUCKETS, graph_kinds, moe_working_set_bytes
from harness.port.sharding import bytes_per_rank, dtype_bytes, plan_model

GiB = 1 << 30
CORE_HBM = 16 * GiB  # one NeuronCore-v2's share of an Inferentia2 chip's 32 GiB (AWS, Inf2 instances)
# A graph's binary and scratch: published, not measured here: aws-neuron-sdk issue 1210 reports a
# 40 MB prefill NEFF for an 8B model (800 MB for a decode graph whose ArgMax the port does not have).
GRAPH_OVERHEAD_BYTES = 64 << 20
# The runtime's own device memory on a core (its scratch, DMA rings, activations between ops): an
# estimate, not measured; nothing published gives it for inf2. What a loaded build's core holds
# beyond the counted parts is the first device run's measurement (harness/plan/calibration.py).
RUNTIME_RESERVE_BYTES = 1 * GiB


def capture_bytes_per_row(spec: ModelSpec, nbytes: int) -> int:
    """Bytes a parity graph returns per position beyond the logits: per layer the attention and MLP
    residuals and the layer's output (hidden each), the gated per-layer input (PLE), the router's
    logits (build dtype) and the chosen experts' weights (fp32) (MoE); then the final norm. The
    embeddings are the graph's own input, taken on the host (graphs.HOST_CAPTURES)."""
    layer = 3 * spec.hidden_size * nbytes + spec.per_layer_input_size * nbytes
    if spec.moe is not None:
        layer += spec.moe.num_experts * (nbytes + 4)
    return spec.num_layers * layer + spec.hidden_size * nbytes


def draft_capture_bytes(assistant, target_hidden: int, nbytes: int) -> int:
    """A parity draft graph's captures (port/drafter.py): the pre-projection, each layer's output and
    the final norm (the assistant's width), the post-projection (the target's), the chosen clusters
    (int64, a masked head only) and the drafter's own logits."""
    clusters = 8 * assistant.top_k_centroids if assistant.ordered else 0
    return ((len(assistant.layers) + 2) * assistant.hidden_size + target_hidden + assistant.vocab_size) * nbytes + clusters


def graph_io_bytes(spec: ModelSpec, length: int, nbytes: int, *, rows: int = 1, capture: bool = False,
                   batched: bool = False, kind: str = "prefill", assistant=None) -> int:
    """One graph's inputs + outputs on a rank (what graphs.TracedDecoder / TracedBatchDecoder take
    and return), for `rows` sequences of `length` positions. Inputs: inputs_embeds [rows, s, width]
    in the build's dtype, int32 positions [rows, s], a batched build's int32 seq_ids [rows], a
    perf build's int32 last_index (one per row; none on a verify graph). Outputs: the logits over
    the whole vocabulary (lm_head all-gathers its shards, so every rank returns all of it, in the
    build's dtype): every row on a parity build (`capture`) and on a perf verify graph, else one per
    sequence; a parity build's captures (capture_bytes_per_row); a perf verify graph's final norm
    states. A "draft" graph (draft_graphs.py) takes the token's embedding, the carried state, its
    position and in a batched build the drafting slot (draft_seq), and returns one row of logits and
    the state; on a parity build also the `assistant`'s captures (draft_capture_bytes)."""
    h = spec.hidden_size
    if kind == "draft":
        captures = draft_capture_bytes(assistant, h, nbytes) if capture and assistant is not None else 0
        return rows * (2 * h * nbytes + 4 + 4 * batched + spec.vocab_size * nbytes + h * nbytes + captures)
    every_row = capture or kind == "verify"
    inputs = length * (input_width(spec) * nbytes + 4) + 4 * batched + 4 * (not every_row)
    outputs = (length if every_row else 1) * spec.vocab_size * nbytes
    if capture:
        outputs += length * capture_bytes_per_row(spec, nbytes)
    elif every_row:  # a perf build's verify graph: every row's final norm too (graphs.TracedDecoder)
        outputs += length * h * nbytes
    return rows * (inputs + outputs)


def input_width(spec: ModelSpec) -> int:
    """The width of a graph's one input (graphs.input_width: hidden, plus each layer's per-layer row)."""
    return spec.hidden_size + spec.num_layers * spec.per_layer_input_size


def graphs_bytes(spec: ModelSpec, tp: int, graphs, nbytes: int, rows: int = 1, capture: bool = False,
                 batched: bool = False, assistant=None) -> dict:
    """Per-graph cost of the compiled graphs [(kind, length, KV bucket), ...] (graph_kinds) of
    `rows` sequences each (`batched`: a build of several KV slots, taking seq_ids): each graph's I/O
    (graph_io_bytes; a parity build when `capture`, else a perf build) plus GRAPH_OVERHEAD_BYTES,
    and the largest MoE working set over their calls."""
    io = [graph_io_bytes(spec, length, nbytes, rows=rows, capture=capture, batched=batched, kind=kind,
                         assistant=assistant)
          + GRAPH_OVERHEAD_BYTES for kind, length, _ in graphs]
    moe = max((moe_working_set_bytes(spec, tp, rows * length, nbytes) for _, length, _ in graphs), default=0)
    return {"count": len(io), "per_graph": max(io, default=0), "graphs": sum(io), "moe_working_set": moe}


def graph_reserve_bytes(spec: ModelSpec, tp: int, nbytes: int, buckets) -> int:
    """An upper bound, whatever the KV length, of one rank's graph cost (graphs_bytes' I/O,
    instructions and MoE working set) for `buckets` in the build that serves a long context (a perf
    build of one sequence, as `info --batch`'s fit counts it): every length at MAX_KV_BUCKETS KV
    buckets. What the longest context that fits (sharding.memory_plan) leaves room for; a parity
    build's captures are the check's fit (instances.core_bytes), not a serving plan's."""
    lengths = sorted({int(b) for b in buckets} | {1})
    shapes = [("decode" if n == 1 else "prefill", n, 0) for n in lengths for _ in range(MAX_KV_BUCKETS)]
    cost = graphs_bytes(spec, tp, shapes, nbytes)
    return cost["graphs"] + cost["moe_working_set"]


def quantized_shapes(spec: ModelSpec, tp: int) -> list[tuple[int, int]]:
    """Every per-rank [rows, cols] weight --quantize int8 stores quantized (inputs/quantize.QUANTIZED)."""
    shapes = []
    for layer, plan in zip(spec.layers, plan_model(spec, tp)):
        h, d, mlp = spec.hidden_size, layer.head_dim, spec.mlp_size(layer) // tp
        q = plan.q_heads_per_rank * d
        shapes += [(q, h), (h, q), (mlp, h), (mlp, h), (h, mlp)]
        if layer.kv_source is None:  # a KV-shared layer has no k/v projections
            shapes += [(plan.kv_heads_per_rank * d, h)] * (1 if layer.k_eq_v else 2)
    return shapes


def weight_savings(spec: ModelSpec, tp: int, dtype: str) -> dict:
    """Per rank: the quantized projections' bytes in `dtype`, as int8 codes, and their scales."""
    shapes = quantized_shapes(spec, tp)
    scales = sum(r for r, _ in shapes) * 4
    return {"unquantized_bytes": sum(r * c for r, c in shapes) * dtype_bytes(dtype),
            "codes_bytes": sum(quantized_weight_bytes(r, c) for r, c in shapes) - scales, "scale_bytes": scales}


def weight_bytes(spec: ModelSpec, tp: int, dtype: str, quantize: str | None = None) -> int:
    """One rank's device weights as they load: in `dtype`, the quantized projections as int8 codes
    and fp32 scales under `quantize` (the rest stays in `dtype`)."""
    weights = bytes_per_rank(spec, tp, dtype, 0)["weights"]
    if not quantize:
        return weights
    saved = weight_savings(spec, tp, dtype)
    return weights - saved["unquantized_bytes"] + saved["codes_bytes"] + saved["scale_bytes"]


def rank_bytes(spec: ModelSpec, tp: int, dtype: str, kv_len: int, sliding_cache: str = "linear",
               quantize: str | None = None) -> dict:
    """sharding.bytes_per_rank with the weights as they load (weight_bytes: int8 codes and scales
    under `quantize`): what every bytes-per-rank and HBM line counts (info, the roofline's HBM fit)."""
    memory = bytes_per_rank(spec, tp, dtype, kv_len, sliding_cache)
    weights = weight_bytes(spec, tp, dtype, quantize)
    return {**memory, "weights": weights, "total": weights + memory["kv_cache"], "quantize": quantize}


def core_bytes(spec: ModelSpec, tp: int, dtype: str = "bfloat16", kv_len: int = 256, sliding_cache: str = "linear",
               *, buckets=DEFAULT_BUCKETS, layout: bool = False, speculate: int = 0, assistant=None,
               batch: int = 1, perf: bool = False, quantize: str | None = None) -> dict:
    """One NeuronCore's device memory for a build. `run`: weights as they load (weight_bytes:
    int8 under `quantize`), KV cache (`batch` slots), the compiled graphs' I/O and binaries (each
    (length, KV bucket) one graph, at every batch bucket of a batched build, a draft graph once:
    one sequence drafts per call; graph_io_bytes: a `perf` build returns one row of logits per
    sequence, a parity build every row and its captures), the MoE working set of the largest call
    and RUNTIME_RESERVE_BYTES. The weight-layout transform (NxD's set_weights re-lays the weights out
    on the device before the states exist) would hold the weights plus at least the largest weight
    re-laid out (`layout_least`), at most a second copy of every weight (`layout_most`; the
    transformer is closed source, unverified): both always computed, counted in `total` (the larger
    of the run and the least the load needs) only with `layout`. A speculative build (`speculate` =
    k) adds the verify graph; with the `assistant` (an AssistantSpec) its drafter's weights
    (`drafter`) and its draft graphs, compiled into the target's model, are on the same core."""
    from harness.port.graphs import batch_buckets

    per_rank = bytes_per_rank(spec, tp, dtype, kv_len, sliding_cache)
    weights = weight_bytes(spec, tp, dtype, quantize)
    nbytes = dtype_bytes(dtype)
    drafter = assistant.bytes_per_rank(tp, nbytes) if assistant is not None else 0
    shapes = graph_kinds(buckets, kv_len, speculate, drafts=assistant is not None)
    rows = batch_buckets(batch) if batch > 1 else (1,)
    per_bucket, drafts = [g for g in shapes if g[0] != "draft"], [g for g in shapes if g[0] == "draft"]
    costs = [graphs_bytes(spec, tp, per_bucket, nbytes, rows=b, capture=not perf, batched=batch > 1) for b in rows]
    if drafts:  # one sequence drafts per call: each draft graph once, at every batch size (draft_graphs.py)
        costs.append(graphs_bytes(spec, tp, drafts, nbytes, capture=not perf, batched=batch > 1, assistant=assistant))
    graphs = {"count": sum(c["count"] for c in costs), "per_graph": max(c["per_graph"] for c in costs),
              "graphs": sum(c["graphs"] for c in costs), "moe_working_set": max(c["moe_working_set"] for c in costs)}
    kv_cache = per_rank["kv_cache"] * batch
    run = weights + kv_cache + drafter + graphs["graphs"] + graphs["moe_working_set"] + RUNTIME_RESERVE_BYTES
    largest = spec.vocab_size // tp * spec.hidden_size * nbytes  # the lm_head shard
    if spec.moe is not None:
        largest = max(largest, spec.moe.num_experts * 2 * (spec.moe.intermediate_size // tp) * spec.hidden_size * nbytes)
    resident = weights + drafter + graphs["count"] * GRAPH_OVERHEAD_BYTES + RUNTIME_RESERVE_BYTES
    least, most = resident + largest, resident + weights + drafter
    return {"weights": weights, "quantize": quantize, "kv_cache": kv_cache, "drafter": drafter, "batch": batch,
            "graphs": graphs["count"], "graph_bytes": graphs["graphs"], "per_graph_bytes": graphs["per_graph"],
            "moe_working_set": graphs["moe_working_set"], "reserve": RUNTIME_RESERVE_BYTES, "run": run,
            "layout": layout, "layout_least": least, "layout_most": most, "total": max(run, least) if layout else run}


__all__ = ["CORE_HBM", "GRAPH_OVERHEAD_BYTES", "RUNTIME_RESERVE_BYTES", "capture_bytes_per_row", "core_bytes",
           "draft_capture_bytes", "graph_io_bytes", "graph_reserve_bytes", "graphs_bytes", "input_width",
           "quantized_shapes", "rank_bytes", "weight_bytes", "weight_savings"]
