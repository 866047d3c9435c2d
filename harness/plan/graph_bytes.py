"""Each compiled device graph's own bytes on a NeuronCore: its inputs + outputs (held to the graphs
themselves: plan/traced_io.py, tests/unit/test_fit_io.py) and an estimate of its instructions and
scratch, summed over a build's graphs (port/device_plan.graph_kinds) with the MoE working set of
its largest call (port/device_plan.moe_working_set_bytes). Every (length, KV bucket) is its own
NEFF with its own instructions and I/O buffers (inputs, logits, captures).
"""

from __future__ import annotations

from harness.inputs.spec import ModelSpec
from harness.port.device_plan import MAX_KV_BUCKETS, moe_working_set_bytes

GRAPH_OVERHEAD_BYTES = 32 << 20  # instructions + runtime scratch per compiled graph (an estimate, unmeasured)


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


__all__ = ["GRAPH_OVERHEAD_BYTES", "capture_bytes_per_row", "draft_capture_bytes", "graph_io_bytes", "graph_reserve_bytes", "graphs_bytes",
           "input_width"]
