"""Roofline floors per device graph: the least time the hardware could take for one call.

For each graph (prefill at a bucket, one decode step) three costs come from the spec and the TP
plan (harness.sharding), summed over the ranks of the chip:
  * bytes read from device memory: every rank's weights once, plus the whole KV cache the static
    graph attends over (both K and V, every layer) and the slots it writes;
  * FLOPs: 2 per weight per token for every projection and the lm_head, and the two attention
    matmuls over the compiled KV length;
  * bytes over the host link: the host-side embeddings in, the last real position's raw logits out
    (a perf build returns only the row greedy decode needs).
Each floor is cost / rate; the graph's floor is the largest (the resource that binds), and its
efficiency is floor / measured median. Activations are left out: at these token counts they stay
on chip and are a small fraction of the weight bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from harness.errors import HarnessInputError
from harness.settings import DEFAULT_KV_LEN, PUBLISHED_BUCKET
from harness.sharding import bytes_per_rank, plan_layer, plan_model
from harness.spec import ModelSpec, dtype_bytes

GiB = 2**30
# Per Inferentia2 chip, from the AWS Neuron documentation, "Inferentia2 Architecture" and "Amazon
# EC2 Inf2 Architecture" (awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/
# neuron-hardware/inferentia2.html and inf2-arch.html): two NeuronCore-v2, 190 FP16/BF16 TFLOPS,
# 47.5 FP32 TFLOPS, 32 GiB HBM at 820 GiB/s. (Older editions of the page wrote "32GB" and
# "820 GB/sec"; the larger, GiB reading is used so that the floor is never overstated.)
CHIP = {"cores": 2, "hbm_bytes": 32 * GiB, "hbm_bytes_per_s": 820 * GiB,
        "flops_per_s": {"bf16": 190e12, "fp32": 47.5e12}}
# The host link is not in that documentation: 32e9 B/s per direction is an assumption (the nominal
# rate of a PCIe Gen4 x16 link), so the host floor is an estimate, marked as such in every output.
HOST_LINK_BYTES_PER_S = 32e9
CHIP_SOURCE = ("AWS Neuron docs, Inferentia2 Architecture / Amazon EC2 Inf2 Architecture (per chip: "
               "2 NeuronCore-v2, 190 BF16 TFLOPS, 47.5 FP32 TFLOPS, 32 GiB HBM at 820 GiB/s); host "
               "link 32 GB/s assumed (PCIe Gen4 x16), not published")
# Inferentia2 chips per instance type (same source, the Inf2 instance table).
INSTANCE_CHIPS = {"inf2.xlarge": 1, "inf2.8xlarge": 1, "inf2.24xlarge": 6, "inf2.48xlarge": 12}
DEFAULT_INSTANCE = "inf2.8xlarge"
# The published port's first-token prefill of the real 12B at TP=2 (docs/design.md#performance-facts).
PUBLISHED_PREFILL_MS, PUBLISHED_PREFILL_BUCKET = 101.0, PUBLISHED_BUCKET


@dataclass(frozen=True)
class Rates:
    """What the floors divide by: memory bytes/s, FLOP/s, host-link bytes/s (None: no link)."""

    name: str
    memory_bytes_per_s: float
    flops_per_s: float
    host_link_bytes_per_s: float | None
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def instance_rates(instance: str, tp: int, dtype: str = "bf16") -> Rates:
    """The published figures of the chips a TP group of `tp` NeuronCores spans on `instance`."""
    if instance not in INSTANCE_CHIPS:
        raise HarnessInputError(f"unknown instance type {instance!r}; known: {', '.join(INSTANCE_CHIPS)}")
    chips = math.ceil(tp / CHIP["cores"])
    if chips > INSTANCE_CHIPS[instance]:
        raise HarnessInputError(f"tp={tp} needs {chips} Inferentia2 chips; {instance} has "
                                f"{INSTANCE_CHIPS[instance]}")
    peak = CHIP["flops_per_s"]["bf16" if dtype in ("bf16", "bfloat16") else "fp32"]
    return Rates(f"{instance} ({chips} chip{'s' * (chips > 1)}, {tp} NeuronCores)",
                 chips * CHIP["hbm_bytes_per_s"], chips * peak, chips * HOST_LINK_BYTES_PER_S, CHIP_SOURCE)


def measured_rates(bandwidth: dict, matmul: dict) -> Rates:
    """This machine's measured figures (the CPU backend: the host is the device, no link)."""
    return Rates("this machine (measured)", bandwidth["bytes_per_s"], matmul["flops_per_s"], None,
                 f"measured: {bandwidth['method']}; {matmul['method']}")


def lm_head_params_per_rank(spec: ModelSpec, tp: int) -> int:
    return spec.vocab_size * spec.hidden_size // tp


def matmul_params_per_rank(spec: ModelSpec, tp: int) -> int:
    """Weights of every decoder-layer projection one rank multiplies by, per token (lm_head apart:
    the perf build runs it on the last real position only)."""
    total = 0
    for layer, plan in zip(spec.layers, plan_model(spec, tp)):
        h, d = spec.hidden_size, layer.head_dim
        kv_mats = 0 if layer.kv_source is not None else (1 if layer.k_eq_v else 2)  # KV-shared: none
        total += 2 * h * plan.q_heads_per_rank * d + kv_mats * h * plan.kv_heads_per_rank * d
        total += 3 * h * spec.mlp_size(layer) // tp + 2 * h * spec.per_layer_input_size
        if spec.moe is not None:  # the router, and the k experts a token uses (1/tp of each)
            total += spec.moe.num_experts * h + 3 * spec.moe.top_k * spec.moe.intermediate_size * h // tp
    return total


def experts_read(spec: ModelSpec, tokens: int) -> float:
    """Experts a call reads per MoE layer: a decode token reads its top-k; `tokens` tokens routed
    uniformly read E (1 - (1 - k/E)^tokens) distinct experts in expectation (at most all E)."""
    e, k = spec.moe.num_experts, spec.moe.top_k
    return e * (1 - (1 - k / e) ** tokens)


def unread_expert_bytes(spec: ModelSpec, tp: int, dtype: str, tokens: int) -> float:
    """Bytes of the experts a call does not read (summed over ranks), to take off the weight bytes:
    the floor counts the experts actually read, not all of them."""
    if spec.moe is None:
        return 0.0
    per_expert = 3 * spec.moe.intermediate_size * spec.hidden_size * dtype_bytes(dtype)  # over all ranks
    return spec.num_layers * (spec.moe.num_experts - experts_read(spec, tokens)) * per_expert


def graph_costs(spec: ModelSpec, tp: int, dtype: str, tokens: int, kv_len: int) -> dict:
    """Bytes and FLOPs of one call of the graph that runs `tokens` tokens against a KV cache of
    `kv_len` slots, summed over the `tp` ranks."""
    nbytes = dtype_bytes(dtype)
    memory = bytes_per_rank(spec, tp, dtype, kv_len)
    kv_write = sum(2 * plan_layer(layer, tp).kv_heads_per_rank * tokens * layer.head_dim * nbytes
                   for layer in spec.layers if layer.kv_source is None)
    attention = sum(2 * 2 * plan_layer(layer, tp).q_heads_per_rank * layer.head_dim * tokens * kv_len
                    for layer in spec.layers)
    return {
        "tokens": tokens, "kv_len": kv_len,
        "weight_bytes": tp * memory["weights"] - unread_expert_bytes(spec, tp, dtype, tokens),
        "kv_bytes": tp * (memory["kv_cache"] + kv_write),
        # the perf build (what is timed) runs lm_head on the last real row and returns that row only
        "flops": tp * (2 * tokens * matmul_params_per_rank(spec, tp) + 2 * lm_head_params_per_rank(spec, tp)
                       + attention),
        # E2B/E4B: each token's per-layer table row rides in with its embedding
        "host_bytes": tokens * (spec.hidden_size + spec.num_layers * spec.per_layer_input_size) * nbytes
                      + spec.vocab_size * nbytes,
    }


def floors(costs: dict, rates: Rates) -> dict:
    """Each cost over its rate, in ms, and the binding one."""
    out = {"memory_ms": (costs["weight_bytes"] + costs["kv_bytes"]) / rates.memory_bytes_per_s * 1e3,
           "compute_ms": costs["flops"] / rates.flops_per_s * 1e3,
           "host_ms": (costs["host_bytes"] / rates.host_link_bytes_per_s * 1e3
                       if rates.host_link_bytes_per_s else None)}
    bound = max((k for k in out if out[k] is not None), key=lambda k: out[k])
    out.update(floor_ms=out[bound], bound=bound[:-len("_ms")])
    return out


def graph_floors(spec: ModelSpec, tp: int, dtype: str, buckets, kv_len: int, rates: Rates) -> list[dict]:
    """One row per graph: prefill at each bucket, then one decode step."""
    graphs = [(f"prefill[{b}]", b) for b in sorted(buckets)] + [("decode", 1)]
    rows = []
    for name, tokens in graphs:
        costs = graph_costs(spec, tp, dtype, tokens, kv_len)
        rows.append({"graph": name, **costs, **floors(costs, rates)})
    return rows


def with_efficiency(rows: list[dict], measured_ms: dict[str, float]) -> list[dict]:
    """Add the measured median and floor / measured to each row that was measured."""
    out = []
    for row in rows:
        ms = measured_ms.get(row["graph"])
        out.append({**row, "measured_ms": ms,
                    "efficiency": row["floor_ms"] / ms if ms else None})
    return out


def roofline_block(spec: ModelSpec, tp: int, dtype: str, buckets, kv_len: int, rates: Rates,
             measured_ms: dict[str, float] | None = None) -> dict:
    """The roofline block of a bench result (and of `info --perf`)."""
    rows = graph_floors(spec, tp, dtype, buckets, kv_len, rates)
    return {"rates": rates.to_dict(), "tp": tp, "dtype": dtype,
            "graphs": with_efficiency(rows, measured_ms or {})}


def info_floors(spec: ModelSpec, tp: int, dtype: str = "bf16", kv_len: int = DEFAULT_KV_LEN,
                buckets=(PUBLISHED_BUCKET,), instance: str = DEFAULT_INSTANCE) -> dict:
    """`gemma-parity info --perf`: the published instance's floors, nothing run or measured, beside
    the published port's prefill (docs/design.md#performance-facts: about 101 ms at bucket 64)."""
    if math.ceil(tp / CHIP["cores"]) > INSTANCE_CHIPS[instance]:  # the family's larger variants
        instance = next(name for name, chips in INSTANCE_CHIPS.items() if chips * CHIP["cores"] >= tp)
    out = roofline_block(spec, tp, dtype, buckets, kv_len, instance_rates(instance, tp, dtype))
    if not spec.is_family:  # the published figure is the 12B's
        out["published_ms"] = {f"prefill[{PUBLISHED_PREFILL_BUCKET}]": PUBLISHED_PREFILL_MS}
    return out
