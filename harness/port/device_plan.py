"""Device memory of one NeuronCore beyond weights and KV cache: the mixture-of-experts working set,
the weight-layout transform, and each compiled graph's own instructions and I/O buffers.

One home for these decisions: the MoE block (harness/port/blocks.py) asks `moe_gathers` which way
to run, and the fit (harness/perf/instances.py) counts what that way holds on the core.

- **MoE** (as neuronx-distributed's ExpertMLPsV2 in inference: selective loading when
  tokens x top-k / experts < DEFAULT_SELECTIVE_LOADING_THRESHOLD = 1.0, else every expert): a call
  of `t` tokens gathers the chosen experts' weights by index only when `t * top_k < num_experts`
  (decode); otherwise every token runs through every expert, `EXPERT_BLOCK` experts at a time, and
  the routing weights (zero for an expert not chosen) select the outputs. Gathering for a prefill
  bucket would copy `t * k` experts' weights per layer ([t, k, ...]): 5.67 GiB per layer for the
  26B-A4B at TP 4 and a 256 bucket, beside 11.79 GiB of weights.
- **Layout transform**: with a priority graph (`layout_priority`; off by default until a device run
  measures it) NxD compiles a layout transformer that re-lays out the weights on the device; both
  layouts may be resident at once (unverified: the transformer is closed source), so the fit
  counts the weights twice when it is on and a run that fits only without it names
  `layout_priority=none`.
- **Per graph**: every (length, KV bucket) is its own NEFF with its own instructions and I/O
  buffers (inputs, logits, captures); `GRAPH_OVERHEAD_BYTES` is an estimate per graph of the
  instructions and scratch beyond the I/O counted exactly.
"""

from __future__ import annotations

from harness.inputs.spec import ModelSpec

EXPERT_BLOCK = 32  # experts run at once in the all-experts path (bounds its activations)
GRAPH_OVERHEAD_BYTES = 32 << 20  # instructions + runtime scratch per compiled graph (an estimate, unmeasured)
MAX_KV_BUCKETS = 8  # KV buckets per run (graphs = lengths x KV buckets); more is refused


def kv_buckets(buckets, max_len: int) -> tuple[int, ...]:
    """KV lengths the graphs read (their KV buckets): powers of two from the smallest prefill
    bucket (at least 16) up to the KV length, and the KV length itself. A graph reads the smallest
    KV bucket that holds every position written so far, so a decode step at position 300 reads 512
    slots, not a 128K cache. Every KV bucket is a whole graph per length (instructions, I/O), so at
    most MAX_KV_BUCKETS: past it the step grows (x4, x8, ...) until they fit."""
    first = 16
    while first < min(int(b) for b in buckets):
        first *= 2
    step = 2
    while True:
        out, size = [], first
        while size < max_len:
            out.append(size)
            size *= step
        if len(out) + 1 <= MAX_KV_BUCKETS:
            return tuple(out) + (max_len,)
        step *= 2


def graph_kinds(buckets, max_len: int, speculate: int = 0, drafts: bool = False) -> list[tuple[str, int, int]]:
    """(kind, sequence length, KV bucket) of every compiled graph (graphs.kv_graph_plan's): each
    prefill bucket ("prefill") at each KV bucket holding it, "decode" (1) at every KV bucket, with
    `speculate` = k the "verify" graph (k+1 positions, a graph of its own even where a bucket has
    its length) at each KV bucket holding it, and with `drafts` the drafter's one-position "draft"
    graph per KV bucket (neuron_drafter's draft_kv<bucket>, compiled into the target's model)."""
    lengths = [("decode" if n == 1 else "prefill", n) for n in sorted({int(b) for b in buckets} | {1})]
    lengths += [("verify", int(speculate) + 1)] if speculate else []
    kvs = kv_buckets(buckets, max_len)
    return [(kind, n, kv) for kind, n in lengths for kv in kvs if kv >= n] + ([("draft", 1, kv) for kv in kvs]
                                                                              if drafts else [])


def graph_shapes(buckets, max_len: int, speculate: int = 0, drafts: bool = False) -> list[tuple[int, int]]:
    """(sequence length, KV bucket) of every compiled graph (graph_kinds without the kind)."""
    return [(n, kv) for _, n, kv in graph_kinds(buckets, max_len, speculate, drafts)]


def moe_gathers(tokens: int, top_k: int, num_experts: int) -> bool:
    """True when a call of `tokens` tokens gathers its chosen experts' weights (t * k < E: decode);
    False: every token runs through every expert, in blocks (prefill)."""
    return tokens * top_k < num_experts


def moe_working_set_bytes(spec: ModelSpec, tp: int, tokens: int, nbytes: int) -> int:
    """Peak bytes of one MoE layer's expert computation on one rank for a call of `tokens` tokens:
    the gathered weights ([t, k] experts' 1/tp slices) when gathering, else one block of experts'
    activations (gate/up [t, B, 2m], the gelu product [t, B, m], outputs [t, B, h] and their fp32
    weighted copy)."""
    if spec.moe is None:
        return 0
    m, h = spec.moe.intermediate_size // tp, spec.hidden_size
    if moe_gathers(tokens, spec.moe.top_k, spec.moe.num_experts):
        return tokens * spec.moe.top_k * 3 * m * h * nbytes
    block = min(EXPERT_BLOCK, spec.moe.num_experts)
    return tokens * block * ((3 * m + h) * nbytes + 4 * h)


def capture_bytes_per_row(spec: ModelSpec, nbytes: int) -> int:
    """Bytes a parity graph returns per position beyond the logits: per layer the attention and MLP
    residuals and the layer's output (hidden each), the gated per-layer input (PLE), the router's
    logits (build dtype) and the chosen experts' weights (fp32) (MoE); then the final norm. The
    embeddings are the graph's own input, taken on the host (graphs.HOST_CAPTURES)."""
    layer = 3 * spec.hidden_size * nbytes + spec.per_layer_input_size * nbytes
    if spec.moe is not None:
        layer += spec.moe.num_experts * (nbytes + 4)
    return spec.num_layers * layer + spec.hidden_size * nbytes


def graph_io_bytes(spec: ModelSpec, length: int, nbytes: int, *, rows: int = 1, capture: bool = False,
                   batched: bool = False, kind: str = "prefill") -> int:
    """One graph's inputs + outputs on a rank (what graphs.TracedDecoder / TracedBatchDecoder take
    and return), for `rows` sequences of `length` positions. Inputs: inputs_embeds [rows, s, width]
    in the build's dtype, int32 positions [rows, s], a batched build's int32 seq_ids [rows], a
    perf build's int32 last_index (one per row; none on the unbatched verify graph). Outputs: the
    logits over the whole vocabulary (lm_head all-gathers its shards, so every rank returns all of
    it, in the build's dtype): every row on a parity build (`capture`) and on the unbatched perf
    verify graph, else one per sequence; a parity build's captures (capture_bytes_per_row); the
    unbatched perf verify graph's final norm states. A "draft" graph (draft_graphs.py) takes the
    token's embedding, the carried state and its position and returns one row of logits and the
    state (a drafter's parity captures not counted)."""
    h = spec.hidden_size
    if kind == "draft":
        return rows * (2 * h * nbytes + 4 + spec.vocab_size * nbytes + h * nbytes)
    every_row = capture or (kind == "verify" and not batched)
    inputs = length * (input_width(spec) * nbytes + 4) + 4 * batched + 4 * (not every_row)
    outputs = (length if every_row else 1) * spec.vocab_size * nbytes
    if capture:
        outputs += length * capture_bytes_per_row(spec, nbytes)
    elif every_row:  # the perf build's verify graph: every row's final norm too (graphs.TracedDecoder)
        outputs += length * h * nbytes
    return rows * (inputs + outputs)


def input_width(spec: ModelSpec) -> int:
    """The width of a graph's one input (graphs.input_width: hidden, plus each layer's per-layer row)."""
    return spec.hidden_size + spec.num_layers * spec.per_layer_input_size


def graphs_bytes(spec: ModelSpec, tp: int, graphs, nbytes: int, rows: int = 1, capture: bool = False,
                 batched: bool = False) -> dict:
    """Per-graph cost of the compiled graphs [(kind, length, KV bucket), ...] (graph_kinds) of
    `rows` sequences each (`batched`: a build of several KV slots, taking seq_ids): each graph's I/O
    (graph_io_bytes; a parity build when `capture`, else a perf build) plus GRAPH_OVERHEAD_BYTES,
    and the largest MoE working set over their calls."""
    io = [graph_io_bytes(spec, length, nbytes, rows=rows, capture=capture, batched=batched, kind=kind)
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


__all__ = ["EXPERT_BLOCK", "GRAPH_OVERHEAD_BYTES", "MAX_KV_BUCKETS", "capture_bytes_per_row", "graph_io_bytes",
           "graph_kinds", "graph_shapes", "graph_reserve_bytes", "graphs_bytes", "kv_buckets", "moe_gathers", "moe_working_set_bytes"]
