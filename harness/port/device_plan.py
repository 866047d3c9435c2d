"""The device graphs a build compiles (`graph_kinds`: each length at each KV bucket) and the device
memory of the way the port runs them beyond weights and KV cache: the mixture-of-experts working
set and the weight-layout transform.

One home for these decisions: the MoE block (harness/port/blocks.py) asks `moe_gathers` which way
to run, and the fit (harness/plan/instances.py) counts what that way holds on the core.

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
  buffers, counted by harness/port/core_fit.py.
"""

from __future__ import annotations

from harness.inputs.spec import ModelSpec

EXPERT_BLOCK = 32  # experts run at once in the all-experts path (bounds its activations)
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


__all__ = ["EXPERT_BLOCK", "MAX_KV_BUCKETS", "graph_kinds", "graph_shapes", "kv_buckets", "moe_gathers",
           "moe_working_set_bytes"]
