"""Whether a batch's KV slots fit beside the weights (`info --batch`, the memory plan's most
sequences): a perf build of `batch` KV slots by the one device fit (instances.core_bytes), against
the HBM of the TP group's cores.
"""

from __future__ import annotations

from harness.base.errors import HarnessInputError
from harness.inputs.spec import ModelSpec
from harness.perf.roofline import CHIP, GiB
from harness.port.core_fit import core_bytes


def batch_fit(spec: ModelSpec, tp: int, dtype: str, batch: int, kv_len: int, chip: dict | None = None,
              sliding_cache: str = "linear", buckets=None, quantize: str | None = None) -> dict:
    """A perf build of `batch` KV slots of `kv_len` (what serves a batch) by the one device fit
    (instances.core_bytes: weights, the slots' KV, every batch bucket's graphs, the MoE working set) against each core's HBM (the
    chip's split over its cores), summed over the TP group; `max_batch` the most slots that fit at
    this KV length by the same fit (what the memory plan prints too)."""
    from harness.base.settings import DEFAULT_BUCKETS

    chip = chip or CHIP
    per_core = chip["hbm_bytes"] / chip["cores"]
    build = dict(buckets=buckets or DEFAULT_BUCKETS, perf=True, quantize=quantize)  # int8 weights under --quantize  # what serves a batch: the perf build

    def core(slots: int) -> dict:
        return core_bytes(spec, tp, dtype, kv_len, sliding_cache, **build, batch=slots)

    this = core(batch)
    most = 0
    while most < 256 and core(most + 1)["total"] <= per_core:
        most += 1
    kv_one = core_bytes(spec, tp, dtype, kv_len, sliding_cache, **build)["kv_cache"]
    # per core: a rank is one NeuronCore; the group's figures are tp x these
    return {"batch": batch, "kv_len": kv_len, "weights_bytes": tp * this["weights"], "kv_bytes_per_sequence": tp * kv_one,
            "kv_bytes": tp * this["kv_cache"], "graphs_bytes": tp * (this["graph_bytes"] + this["moe_working_set"]),
            "graphs": this["graphs"], "reserve_bytes": tp * this["reserve"], "needed_bytes": tp * this["total"],
            "capacity_bytes": tp * per_core, "core_bytes": this["total"], "core_capacity_bytes": per_core, "quantize": quantize,
            "fits": this["total"] <= per_core, "max_batch": most}


def fit_table(spec: ModelSpec, tp: int, dtype: str, batches, kv_lens, chip: dict | None = None,
              sliding_cache: str = "linear", quantize: str | None = None) -> list[dict]:
    """batch_fit of every batch size at every KV length."""
    return [batch_fit(spec, tp, dtype, b, n, chip=chip, sliding_cache=sliding_cache, quantize=quantize)
            for n in kv_lens for b in batches]


def refuse_unfit_batch(fit: dict) -> None:
    """Bad input (naming the numbers) when a batch's KV slots do not fit beside the weights."""
    if not fit["fits"]:
        raise HarnessInputError(
            f"--batch {fit['batch']} at --kv-len {fit['kv_len']}: weights {fit['weights_bytes'] / GiB:.2f} GiB + "
            f"{fit['batch']} x {fit['kv_bytes_per_sequence'] / GiB:.3f} GiB of KV + {fit['graphs']} graphs "
            f"{fit['graphs_bytes'] / GiB:.2f} GiB + runtime reserve {fit['reserve_bytes'] / GiB:.2f} GiB = "
            f"{fit['needed_bytes'] / GiB:.2f} GiB over the TP group ({fit['core_bytes'] / GiB:.2f} GiB per core), "
            f"more than the {fit['core_capacity_bytes'] / GiB:.0f} GiB of a NeuronCore; at most {fit['max_batch']} sequences fit "
            "at this KV length (lower --batch or --kv-len)")


__all__ = ["batch_fit", "fit_table", "refuse_unfit_batch"]
