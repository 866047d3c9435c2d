"""What one rank's lowered graph is and must be: the signature naming each entry parameter and output
(`GraphSignature`), and what the spec and the sharding plan say its shapes, state and attention
reads are (`Expectation`: `expectation_for` a target graph, `draft_expectation` a drafter's), the
inputs of the graph contracts (harness/hlo/contracts.py) and statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.port.sharding import plan_model, ring_windows, shard_layer, shard_lm_head

HLO_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}


@dataclass(frozen=True)
class GraphSignature:
    """What the entry parameters and outputs of one lowered graph are."""
    params: list[tuple[str, str]]  # per entry parameter: (role, name); role in input, weight, constant,
    # state, scalar, target_kv (a draft graph's read-only view of the target's KV state)
    outputs: list[str]
    host_transfers: int | None = None  # device->host round trips while tracing (None: not measured)


@dataclass(frozen=True)
class Expectation:
    """What the spec and the sharding plan say one rank's graph must look like."""
    length: int
    max_len: int
    hidden: int
    num_layers: int
    dtype: str  # activation dtype in HLO spelling (bf16)
    vocab_sizes: frozenset[int]
    weight_shapes: dict[str, tuple[int, ...]]
    kv_shapes: dict[str, tuple[int, ...]]
    # keys attention reads -> how many layers read that many: the KV bucket on a linear cache
    # (max_len when not bucketed), window + length on a ring; None: every layer reads max_len
    reads: dict[int, int] | None = None
    rings: frozenset[str] = frozenset()  # ring buffers: prefill selects every slot, decode writes one; never sliced


def plan_weight_shapes(spec, tp: int, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """One rank's weight names and shapes, by the sharding plan's own functions on meta tensors."""
    from harness.inputs.shapes import expected_layer_shapes

    shapes = {}
    for layer, plan in zip(spec.layers, plan_model(spec, tp)):
        full = {n: torch.empty(s, device="meta") for n, s in expected_layer_shapes(spec, layer).items()}
        for name, t in shard_layer(full, plan, rank).items():
            shapes[f"layers.{layer.index}.{name}"] = tuple(t.shape)
    shapes["norm.weight"] = (spec.hidden_size,)
    lm_head = shard_lm_head(torch.empty(spec.vocab_size, spec.hidden_size, device="meta"), tp, rank)
    shapes["lm_head.weight"] = tuple(lm_head.shape)
    return shapes


def expectation_for(spec, tp: int, max_len: int, length: int, dtype: torch.dtype, rank: int = 0,
                    sliding_cache: str = "linear", kv_read: int | None = None) -> Expectation:
    """What one rank's graph of `length` positions must look like: state of the plan's shapes (a
    ring's window for sliding layers under the ring cache), attention reading `kv_read` keys of a
    linear cache (its KV bucket; None: max_len) and window + length keys of a ring."""
    kv, reads, rings = {}, {}, set()
    windows = ring_windows(spec, sliding_cache, max_len)
    for layer, plan in zip(spec.layers, plan_model(spec, tp)):
        slots = windows.get(layer.index, max_len)
        for buf in ("k", "v"):
            name = f"layers.{layer.index}.self_attn.cache.{buf}"
            kv[name] = (1, plan.kv_heads_per_rank, slots, layer.head_dim)
            if layer.index in windows:
                rings.add(name)
        keys = slots + length if layer.index in windows else (kv_read or max_len)
        reads[keys] = reads.get(keys, 0) + 1
    return Expectation(length, max_len, spec.hidden_size, spec.num_layers, dtype=HLO_DTYPES[dtype],
                       vocab_sizes=frozenset({spec.vocab_size, spec.vocab_size // tp}),
                       weight_shapes=plan_weight_shapes(spec, tp, rank), kv_shapes=kv, reads=reads,
                       rings=frozenset(rings))


def draft_expectation(aspec, target_spec, tp: int, max_len: int, dtype: torch.dtype,
                      weight_shapes: dict[str, tuple[int, ...]]) -> Expectation:
    """What one rank's draft graph must look like: one position, every layer's attention over the
    target's whole cache (max_len keys) of its store layer, read only (kv_shapes: one rank's
    [1, kv heads, max_len, d] per store layer), `weight_shapes` the rank's drafter weights."""
    plans, kv = plan_model(target_spec, tp), {}
    for layer in aspec.layers:
        source = target_spec.layers[layer.kv_source]
        for buf in ("k", "v"):
            kv[f"layers.{layer.kv_source}.self_attn.cache.{buf}"] = (1, plans[source.index].kv_heads_per_rank, max_len,
                                                                     source.head_dim)
    return Expectation(1, max_len, aspec.hidden_size, len(aspec.layers), dtype=HLO_DTYPES[dtype],
                       vocab_sizes=frozenset({aspec.vocab_size}), weight_shapes=dict(weight_shapes), kv_shapes=kv,
                       reads={max_len: len(aspec.layers)})


__all__ = ["HLO_DTYPES", "Expectation", "GraphSignature", "draft_expectation", "expectation_for", "plan_weight_shapes"]
