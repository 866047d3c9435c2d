"""Where a model runs: the inf2 instances, the TP degrees a model's heads and sizes allow, and
whether its weights and KV cache fit one NeuronCore's share of device memory at a TP degree.

An Inferentia2 chip has 2 NeuronCores and 32 GiB of HBM (AWS, "Amazon EC2 Inf2 instances"): one
rank per core, 16 GiB each. The fit counts weights plus the KV cache at the compiled length;
activations and the runtime's own scratch come on top, so a plan using nearly all 16 GiB is
marked tight.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import ShardingError
from harness.sharding import bytes_per_rank, plan_model
from harness.spec import ModelSpec

GIB = 1 << 30
CORE_HBM = 16 * GIB
TIGHT = 0.9  # more than this share of a core's HBM in weights + KV leaves little for activations


@dataclass(frozen=True)
class Instance:
    name: str
    chips: int

    @property
    def cores(self) -> int:
        return 2 * self.chips


INSTANCES = (Instance("inf2.8xlarge", 1), Instance("inf2.24xlarge", 6), Instance("inf2.48xlarge", 12))
MAX_CORES = INSTANCES[-1].cores


def allowed_tps(spec: ModelSpec) -> list[int]:
    """TP degrees up to the largest instance's core count that the heads and sizes split into."""
    allowed = []
    for tp in range(1, MAX_CORES + 1):
        try:
            plan_model(spec, tp)
        except ShardingError:
            continue
        allowed.append(tp)
    return allowed


def smallest_instance(tp: int) -> Instance | None:
    return next((inst for inst in INSTANCES if inst.cores >= tp), None)


def placement(spec: ModelSpec, tp: int, dtype: str = "bfloat16", kv_len: int = 256,
              sliding_cache: str = "linear") -> dict:
    """The instance a TP degree needs and the per-core fit (weights + KV of one rank vs 16 GiB)."""
    per_rank = bytes_per_rank(spec, tp, dtype, kv_len, sliding_cache)["total"]
    inst = smallest_instance(tp)
    fitting = [t for t in allowed_tps(spec)
               if bytes_per_rank(spec, t, dtype, kv_len, sliding_cache)["total"] <= CORE_HBM]
    return {"tp": tp, "instance": inst.name if inst else None, "chips_used": -(-tp // 2),
            "bytes_per_rank": per_rank, "core_hbm": CORE_HBM, "fits": per_rank <= CORE_HBM,
            "tight": per_rank > TIGHT * CORE_HBM, "allowed_tps": allowed_tps(spec),
            "smallest_fitting_tp": fitting[0] if fitting else None}


def check_fits(spec: ModelSpec, tp: int, dtype: str = "bfloat16", kv_len: int = 256,
               sliding_cache: str = "linear") -> dict:
    """placement(), or a ShardingError naming the numbers when no instance has `tp` cores or one
    rank's weights and KV cache exceed a core's HBM."""
    where = placement(spec, tp, dtype, kv_len, sliding_cache)
    if where["instance"] is None:
        raise ShardingError(f"tp={tp} needs {tp} NeuronCores but the largest inf2 instance "
                            f"({INSTANCES[-1].name}) has {MAX_CORES}; the heads allow tp in {where['allowed_tps']}")
    if not where["fits"]:
        better = where["smallest_fitting_tp"]
        hint = f"use --tp {better} or more" if better else "no TP degree up to 24 fits"
        raise ShardingError(
            f"at tp={tp} one rank holds {where['bytes_per_rank'] / GIB:.2f} GiB of weights and KV cache "
            f"({dtype}, kv_len {kv_len}, {sliding_cache} sliding cache) but a NeuronCore has {CORE_HBM / GIB:.0f} GiB; {hint} "
            f"(allowed by the heads: {where['allowed_tps']})")
    return where


def plan_notes(spec: ModelSpec, where: dict) -> list[str]:
    """What `info` says beyond the per-layer table: the instance, the family's extra parts and how
    each is placed."""
    gib = where["bytes_per_rank"] / GIB
    fit = "fits" if where["fits"] else "does NOT fit"
    lines = [f"instance: {where['instance']} ({where['chips_used']} chip(s), tp={where['tp']} ranks, one per "
             f"NeuronCore); weights + KV per rank {gib:.2f} GiB of {CORE_HBM / GIB:.0f} GiB: {fit}"
             + (" (tight: little left for activations)" if where["fits"] and where["tight"] else ""),
             f"TP degrees the heads and sizes allow (up to {MAX_CORES} cores): {where['allowed_tps']}; "
             f"smallest that fits: {where['smallest_fitting_tp']}"]
    shared = [layer for layer in spec.layers if layer.kv_source is not None]
    if shared:
        sources = sorted({layer.kv_source for layer in shared})
        lines.append(f"KV sharing: layers {shared[0].index}-{shared[-1].index} read the cache of layer(s) "
                     f"{sources} (same attention type) and hold no cache or k/v projections of their own")
        wide = [layer.index for layer in shared if layer.intermediate_size]
        if wide:
            lines.append(f"double-wide MLP ({2 * spec.intermediate_size}) on shared layers {wide[0]}-{wide[-1]}")
    if spec.per_layer_input_size:
        lines.append(f"per-layer inputs: packed table {spec.per_layer_vocab_size} x {spec.num_layers}*"
                     f"{spec.per_layer_input_size} on the host (counted in host-side embeddings); the "
                     "projection, norm and per-layer gates replicated on every rank")
    if spec.moe is not None:
        m = spec.moe
        lines.append(f"MoE: {m.num_experts} experts (top-{m.top_k}, width {m.intermediate_size}) split inside "
                     f"each expert across ranks ({m.intermediate_size // where['tp']} per rank), router replicated")
    return lines
