"""Modelled floors at length: TTFT of an L-token prompt prefilled in chunks and TPOT of a decode step
at context L, on the roofline's rates (roofline.py), for the linear or the ring sliding cache.

roofline.graph_costs models every layer's cache as linear at the KV length it is given; here each
call is costed at the KV bucket it reads (graphs.kv_buckets), and under the ring the sliding
layers' reads and attention are their window plus the chunk instead of the bucket.
"""

from __future__ import annotations

from harness.inputs.spec import dtype_bytes
from harness.perf.roofline import floors, graph_costs
from harness.port.engine import chunk_plan
from harness.port.graphs import kv_buckets
from harness.port.sharding import kv_cache_bytes, plan_layer


def call_costs(spec, tp: int, dtype: str, tokens: int, *, kv_read: int, sliding_cache: str) -> dict:
    """graph_costs of one call of `tokens` rows reading `kv_read` slots of the linear caches."""
    costs = graph_costs(spec, tp, dtype, tokens, kv_read)
    if sliding_cache != "ring":
        return costs
    kv = kv_cache_bytes(spec, tp, dtype, "ring")
    writes = sum(2 * plan_layer(layer, tp).kv_heads_per_rank * tokens * layer.head_dim * dtype_bytes(dtype)
                 for layer in spec.layers)
    attention = 0
    for layer in spec.layers:
        keys = layer.window + tokens if layer.is_sliding and layer.window < kv_read else kv_read
        attention += 2 * 2 * plan_layer(layer, tp).q_heads_per_rank * layer.head_dim * tokens * keys
    linear_attention = sum(2 * 2 * plan_layer(layer, tp).q_heads_per_rank * layer.head_dim * tokens * kv_read
                           for layer in spec.layers)
    return {**costs, "kv_bytes": tp * (kv["ring"] + kv["per_token"] * kv_read + writes),
            "flops": costs["flops"] - tp * (linear_attention - attention)}


def context_floors(spec, tp: int, dtype: str, context: int, *, buckets, max_len: int, rates,
                   sliding_cache: str = "ring") -> dict:
    """TTFT floor of a `context`-token prompt (its chunks, each at its KV bucket) and the TPOT floor
    of a decode step at position `context` (its KV bucket), in ms."""
    sizes = kv_buckets(buckets, max_len)
    ttft = 0.0
    for start, length, bucket in chunk_plan(context, buckets, max_len):
        read = min(s for s in sizes if s >= start + length)
        ttft += floors(call_costs(spec, tp, dtype, bucket, kv_read=read, sliding_cache=sliding_cache), rates)["floor_ms"]
    read = min(s for s in sizes if s >= min(context + 1, max_len))
    decode = floors(call_costs(spec, tp, dtype, 1, kv_read=read, sliding_cache=sliding_cache), rates)
    return {"context": context, "sliding_cache": sliding_cache, "ttft_ms": ttft, "tpot_ms": decode["floor_ms"],
            "tpot_bound": decode["bound"], "decode_kv_bucket": read}


CONTEXTS = (1024, 8192, 32768, 131072)


def floors_at_length(spec, tp: int, dtype: str, *, buckets, longest: int, rates, sliding_cache: str) -> list[dict]:
    """context_floors at 1K/8K/32K/128K (those up to `longest`, the longest context that fits) in a
    build whose KV length is `longest`."""
    return [context_floors(spec, tp, dtype, n, buckets=buckets, max_len=longest, rates=rates, sliding_cache=sliding_cache)
            for n in CONTEXTS if n < longest]


def render_floors_at_length(rows: list[dict]) -> str:
    lines = ["| context | TTFT floor (prefill in chunks) | TPOT floor (decode) | decode KV bucket |",
             "|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['ttft_ms']:.0f} ms | {r['tpot_ms']:.1f} ms ({r['tpot_bound']}) | "
              f"{r['decode_kv_bucket']} |" for r in rows]
    return "\n".join(lines) + "\n"
