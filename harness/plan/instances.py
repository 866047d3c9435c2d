"""Where a model runs: the inf2 instances, the TP degrees a model's heads and sizes allow, and
whether its weights and KV cache fit one NeuronCore's share of device memory at a TP degree.

An Inferentia2 chip has 2 NeuronCores and 32 GiB of HBM (AWS, "Amazon EC2 Inf2 instances"): one
rank per core, 16 GiB each. The fit counts weights, the KV cache at the compiled length, every
graph's I/O and instructions, the MoE working set and the weight-layout transform
(harness/port/device_plan.py, harness/port/core_fit.py); other activations and the runtime's scratch come on top, so a plan using
nearly all 16 GiB is marked tight.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.base.errors import HarnessInputError, ShardingError
from harness.base.settings import DEFAULT_BUCKETS
from harness.inputs.spec import ModelSpec
from harness.port.core_fit import CORE_HBM, core_bytes
from harness.port.sharding import plan_model

GIB = 1 << 30
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


def layout_transform(backend_options: dict) -> bool:
    """Whether a build's weights go through NxD's weight-layout transform: when `layout_priority`
    names a graph (the neuron backend's default, neuron_layers.DEFAULT_LAYOUT_PRIORITY, is none)."""
    from harness.backends.neuron_layers import DEFAULT_LAYOUT_PRIORITY

    return backend_options.get("layout_priority", DEFAULT_LAYOUT_PRIORITY) is not None


def placement(spec: ModelSpec, tp: int, dtype: str = "bfloat16", kv_len: int = 256,
              sliding_cache: str = "linear", **build) -> dict:
    """The instance a TP degree needs and the per-core fit (core_bytes vs 16 GiB); `build`:
    core_bytes' keywords (buckets, layout, speculate, assistant)."""
    core = core_bytes(spec, tp, dtype, kv_len, sliding_cache, **build)
    per_rank = core["total"]
    inst = smallest_instance(tp)
    fitting = smallest_fitting_tp(spec, dtype, kv_len, sliding_cache, **build)
    return {"tp": tp, "instance": inst.name if inst else None, "chips_used": -(-tp // 2),
            "bytes_per_rank": per_rank, "core": core, "core_hbm": CORE_HBM, "fits": per_rank <= CORE_HBM,
            "tight": per_rank > TIGHT * CORE_HBM, "allowed_tps": allowed_tps(spec),
            "smallest_fitting_tp": fitting}


def smallest_fitting_tp(spec: ModelSpec, dtype: str = "bfloat16", kv_len: int = 256, sliding_cache: str = "linear",
                        **build) -> int | None:
    """The smallest TP degree the heads allow whose per-core plan fits a NeuronCore and whose chip's
    memory plan holds `kv_len` (the --kv-len check every command makes: a TP this names is one the
    commands then accept), None: none up to the largest instance; `build`: core_bytes' keywords."""
    from harness.plan.kv_fit import refuse_kv_over_chip

    def holds_kv(t: int) -> bool:
        try:
            refuse_kv_over_chip(spec, t, dtype, kv_len, sliding_cache)
        except HarnessInputError:
            return False
        return True

    return next((t for t in allowed_tps(spec)
                 if core_bytes(spec, t, dtype, kv_len, sliding_cache, **build)["total"] <= CORE_HBM and holds_kv(t)),
                None)


def check_fits(spec: ModelSpec, tp: int, dtype: str = "bfloat16", kv_len: int = 256,
               sliding_cache: str = "linear", **build) -> dict:
    """placement(), or a ShardingError naming the numbers and the option that makes it fit when no
    instance has `tp` cores or one core's plan (core_bytes) exceeds its HBM."""
    where = placement(spec, tp, dtype, kv_len, sliding_cache, **build)
    layout = build.get("layout", True)
    if where["instance"] is None:
        raise ShardingError(f"tp={tp} needs {tp} NeuronCores but the largest inf2 instance "
                            f"({INSTANCES[-1].name}) has {MAX_CORES}; the heads allow tp in {where['allowed_tps']}")
    if not where["fits"]:
        core, better = where["core"], where["smallest_fitting_tp"]
        hints = []
        if layout and core["run"] <= CORE_HBM:
            hints.append("--backend-option layout_priority=none (no weight-layout transform)")
        hints.append(f"--tp {better} or more" if better else "no TP degree up to 24 fits")
        raise ShardingError(f"at tp={tp} one NeuronCore needs {core['total'] / GIB:.2f} GiB ({core_summary(core)}) "
                            f"but has {CORE_HBM / GIB:.0f} GiB ({dtype}, kv_len {kv_len}, {sliding_cache} sliding "
                            f"cache). Use {' or '.join(hints)} (allowed by the heads: {where['allowed_tps']})")
    return where


def core_summary(core: dict) -> str:
    """One line of a core's plan: what the run holds (the graphs' sum, and the largest), and what
    the layout transform's load would hold, whether or not it is on."""
    drafter = f", drafter {core['drafter'] / GIB:.2f}" if core.get("drafter") else ""
    slots = f" ({core['batch']} slots)" if core.get("batch", 1) > 1 else ""
    text = (f"weights {core['weights'] / GIB:.2f}{drafter}, KV {core['kv_cache'] / GIB:.2f}{slots}, {core['graphs']} "
            f"graphs {core['graph_bytes'] / GIB:.2f} (largest {core['per_graph_bytes'] / 2**20:.0f} MiB), MoE working "
            f"set {core['moe_working_set'] / GIB:.2f}: run {core['run'] / GIB:.2f} GiB")
    bounds = f"{core['layout_least'] / GIB:.2f}-{core['layout_most'] / GIB:.2f} GiB"
    if core.get("layout", True):
        text += (f"; layout transform load {bounds}"
                 + (" (the upper bound is over a core: if loading fails, --backend-option layout_priority=none)"
                    if core["layout_most"] > CORE_HBM else ""))
    else:
        text += (f"; layout transform off (the default until a device run measures it; "
                 f"--backend-option layout_priority=decode would load {bounds})")
    return text


def plan_notes(spec: ModelSpec, where: dict, parity: dict | None = None) -> list[str]:
    """What `info` says beyond the per-layer table: the instance, the served build's fit (and the
    check's `parity` build's, a core_bytes), the family's extra parts and how each is placed."""
    gib = where["bytes_per_rank"] / GIB
    fit = "fits" if where["fits"] else "does NOT fit"
    lines = [f"instance: {where['instance']} ({where['chips_used']} chip(s), tp={where['tp']} ranks, one per "
             f"NeuronCore); served build per core {gib:.2f} GiB of {CORE_HBM / GIB:.0f} GiB: {fit}"
             + (" (tight: little left for activations)" if where["fits"] and where["tight"] else ""),
             f"per core (served build): {core_summary(where['core'])}",
             *([f"per core (check's parity build, every row's logits and the captures): {core_summary(parity)}"
                + ("" if parity["total"] <= CORE_HBM else f"; does NOT fit {CORE_HBM / GIB:.0f} GiB")]
               if parity else []),
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
