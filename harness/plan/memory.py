"""The memory plan of one inf2 instance: weights, KV bytes per token, the rings' fixed bytes and the
longest context that fits next to the weights, for the linear and the ring sliding cache.

The chip facts (HBM per chip, cores per chip, chips per instance) are roofline.py's; the bytes are
harness.port.sharding's per-rank arithmetic. Ranks fill a chip's cores before the next chip, so on an
inf2.8xlarge (one chip, two NeuronCore-v2) both ranks of TP=2 share its 32 GiB.
"""

from __future__ import annotations

import math

from harness.base.errors import HarnessInputError
from harness.base.settings import DEFAULT_BUCKETS
from harness.perf.roofline import CHIP, DEFAULT_INSTANCE, INSTANCE_CHIPS
from harness.port.core_fit import RUNTIME_RESERVE_BYTES, graph_reserve_bytes, weight_bytes
from harness.port.sharding import dtype_bytes, memory_plan


def instance_for(tp: int) -> str | None:
    """inf2.8xlarge when its chip holds the TP group, else the smallest inf2 with enough chips."""
    chips = math.ceil(tp / CHIP["cores"])
    if chips <= INSTANCE_CHIPS[DEFAULT_INSTANCE]:
        return DEFAULT_INSTANCE
    fitting = sorted((n, name) for name, n in INSTANCE_CHIPS.items() if n >= chips)
    return fitting[0][1] if fitting else None


def instance_memory_plan(spec, tp: int, dtype: str = "bfloat16", kv_len: int = 256,
                         instance: str | None = None, quantize: str | None = None) -> dict:
    """sharding.memory_plan for one chip of `instance` (default: instance_for(tp)) at TP `tp`: the
    most loaded chip."""
    instance = instance or instance_for(tp) or DEFAULT_INSTANCE
    if instance not in INSTANCE_CHIPS:
        raise HarnessInputError(f"unknown instance type {instance!r}; known: {', '.join(INSTANCE_CHIPS)}")
    chips = math.ceil(tp / CHIP["cores"])
    if chips > INSTANCE_CHIPS[instance]:
        raise HarnessInputError(f"--tp {tp} needs {chips} Inferentia2 chips ({CHIP['cores']} cores each); "
                                f"{instance} has {INSTANCE_CHIPS[instance]}")
    # Each NeuronCore-v2 owns its share of the chip's HBM: TP=1 has one core's 16 GiB, not the chip's
    # 32 (the same rule as the per-core fit in harness.plan.instances).
    ranks = min(tp, CHIP["cores"])
    device = (f"one Inferentia2 chip of {instance}" if ranks == CHIP["cores"]
              else f"{ranks} of the {CHIP['cores']} NeuronCores of one Inferentia2 chip of {instance}")
    # the graphs' share and the runtime's, per rank; the weights as they load (int8 under --quantize)
    reserve = graph_reserve_bytes(spec, tp, dtype_bytes(dtype), DEFAULT_BUCKETS) + RUNTIME_RESERVE_BYTES
    plan = memory_plan(spec, tp, dtype, kv_len, device_bytes=CHIP["hbm_bytes"] * ranks // CHIP["cores"],
                       ranks_per_device=ranks, device=device, reserve_bytes=reserve,
                       weights_per_rank=weight_bytes(spec, tp, dtype, quantize))
    return {**plan, "instance": instance, "quantize": quantize,
            "max_batch": max_batch(spec, tp, dtype, kv_len, quantize=quantize)}


def max_batch(spec, tp: int, dtype: str, kv_len: int, sliding_cache: str = "linear", quantize: str | None = None) -> int:
    """The most KV slots (sequences) that fit at `kv_len` by the one device fit (batch_fit.batch_fit,
    instances.core_bytes): what `info --batch` admits and refuses by."""
    from harness.plan.batch_fit import batch_fit

    return batch_fit(spec, tp, dtype, 1, kv_len, sliding_cache=sliding_cache, quantize=quantize)["max_batch"]


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _capped(plan: dict, cache: dict) -> str:
    if cache["longest_context"] < cache["longest_by_memory"]:
        return f", capped at max_position_embeddings {plan['max_positions']}"
    return ""


def render_memory_plan(plan: dict, sliding_cache: str) -> str:
    """The plan as text lines: the arithmetic behind each cache's longest context."""
    lines = [f"memory plan: {plan['device']}, {gib(plan['device_bytes'])} for {plan['ranks_per_device']} "
             f"rank(s); weights {gib(plan['weights_bytes'])}, compiled graphs up to {gib(plan['graphs_reserve_bytes'])} "
             f"and the runtime's reserve (harness/port/core_fit.py){', int8 weights (--quantize)' if plan.get('quantize') else ''}"]
    if plan["weights_bytes"] >= plan["device_bytes"]:
        lines.append(f"  the weights alone exceed {gib(plan['device_bytes'])}: this TP and dtype do not fit the chip")
    for kind, c in plan["caches"].items():
        chosen = " (chosen)" if kind == sliding_cache else ""
        lines.append(
            f"  {kind}{chosen}: KV {c['kv_bytes_per_token'] / 1024:.1f} KiB/token + rings {gib(c['ring_bytes'])}; "
            f"longest context ({gib(plan['device_bytes'])} - {gib(plan['weights_bytes'])} - "
            f"{gib(plan['graphs_reserve_bytes'])} - {gib(c['ring_bytes'])}) / {c['kv_bytes_per_token']} B = {c['longest_by_memory']} tokens"
            f"{_capped(plan, c)}; "
            f"--kv-len {plan['kv_len']} uses {gib(c['total_bytes'])}{'' if c['fits'] else ' (does NOT fit)'}")
    if "max_batch" in plan:
        lines.append(f"  batch at --kv-len {plan['kv_len']}: at most {plan['max_batch']} sequences (the device fit: "
                     "weights, a KV slot each, every batch bucket's graphs; info --batch refuses by the same)")
    return "\n".join(lines)


def refuse_unfit_kv_len(plan: dict, sliding_cache: str) -> None:
    """--kv-len beyond what the chip holds next to the weights is bad input, with the numbers."""
    c = plan["caches"][sliding_cache]
    if c["fits"] or plan["weights_bytes"] + c["ring_bytes"] >= plan["device_bytes"]:
        return  # fits, or the weights alone do not (no --kv-len would: the plan says so, info still shows it)
    other = "ring" if sliding_cache == "linear" else "linear"
    hint = (f"; the ring sliding cache holds {plan['caches'][other]['longest_context']} (--sliding-cache ring)"
            if other == "ring" and plan["caches"]["ring"]["longest_context"] > c["longest_context"] else "")
    raise HarnessInputError(
        f"--kv-len {plan['kv_len']} does not fit {plan['device']}: weights {gib(plan['weights_bytes'])} + graphs "
        f"{gib(plan['graphs_reserve_bytes'])} + rings "
        f"{gib(c['ring_bytes'])} + {c['kv_bytes_per_token']} B/token x {plan['kv_len']} = {gib(c['total_bytes'])} "
        f"> {gib(plan['device_bytes'])}; with the {sliding_cache} sliding cache at most {c['longest_context']} "
        f"tokens fit{hint}")
