"""The resource plan of every command (`info --plan`): peak host memory, device memory per
NeuronCore and the number of compiled graphs, for the model, TP, buckets and KV length asked for,
against the instance's host RAM and HBM.

Device side: harness/perf/instances.py core_bytes (weights, KV cache, graphs, MoE working set, layout
transform). Host side: peak = HOST_MODEL[command].ratio x the model's fp32 bytes. The ratios and
their basis are written beside each one: `check` is one measurement (issue 28: peak RSS 4.3 GiB
on a 0.84 GiB fp32 checkpoint of the 12B's structure, default prompts, cpu backend, on the
project's two-core build machine, 2026), not yet a fit over sizes; the others are counted from
what the command holds at once and are marked "counted". A benchmark fitting them over three or more
sizes (and a test holding the plan within 15% on an unseen size) is still to be written
(docs/design.md#resource-plan).
"""

from __future__ import annotations

from harness.base.errors import ShardingError
from harness.inputs.spec import ModelSpec
from harness.perf.instances import INSTANCES, check_fits, core_bytes, smallest_instance
from harness.port.sharding import bytes_per_rank

GIB = 1 << 30
HOST_RAM = {"inf2.8xlarge": 128 * GIB, "inf2.24xlarge": 384 * GIB, "inf2.48xlarge": 768 * GIB}  # AWS, Inf2 page
COMMANDS = ("check", "reference", "bisect", "quality", "bench")
# command -> (host peak / fp32 model bytes, basis). "measured": a measured run; "counted": the copies
# of the model the command holds at once, read from its code.
HOST_MODEL = {
    "check": (5.1, "measured once: 4.3 GiB peak / 0.84 GiB fp32 (issue 28; two-core build machine, 2026)"),
    "bisect": (5.1, "counted: the same observation as check (observe.py), so check's ratio"),
    "quality": (5.1, "counted: references and the port of check over the corpus, so check's ratio"),
    "reference": (1.5, "counted: one transformers model at a time (reference.run_reference deletes each): "
                       "fp32 1.0 plus the bf16 safetensors pages it reads 0.5"),
    "bench": (1.0, "counted: the port's bf16 ranks (0.5) and the per-rank state dicts while loading (0.5)"),
}


def fp32_model_bytes(spec: ModelSpec) -> int:
    """The text decoder in fp32 as the host holds it: every weight once (tied head), plus the
    per-layer input table of a PLE model."""
    sizes = bytes_per_rank(spec, 1, "float32", 0)
    return sizes["weights"] + spec.per_layer_vocab_size * spec.num_layers * spec.per_layer_input_size * 4


def resource_plan(spec: ModelSpec, tp: int, dtype: str, kv_len: int, buckets, *, sliding_cache: str = "linear",
                  host_bytes: int | None = None, layout: bool = True) -> dict:
    """Per command: host_peak_bytes (and its basis), device_bytes_per_core, graphs, and whether each
    fits; `host_bytes` is the host budget (default: the RAM of the instance the TP degree needs)."""
    inst = smallest_instance(tp)
    budget = host_bytes if host_bytes is not None else HOST_RAM.get(inst.name if inst else "", 0)
    core = core_bytes(spec, tp, dtype, kv_len, sliding_cache, buckets=buckets, layout=layout)
    try:
        check_fits(spec, tp, dtype, kv_len, sliding_cache, buckets=buckets, layout=layout)
        device_problem = None
    except ShardingError as exc:
        device_problem = str(exc)
    model = fp32_model_bytes(spec)
    commands = {}
    for name in COMMANDS:
        ratio, basis = HOST_MODEL[name]
        peak = int(ratio * model)
        commands[name] = {"host_peak_bytes": peak, "host_basis": basis, "fits_host": peak <= budget,
                          "device_bytes_per_core": core["total"], "graphs": core["graphs"],
                          "fits_device": device_problem is None}
    return {"instance": inst.name if inst else None, "host_bytes": budget, "fp32_model_bytes": model,
            "tp": tp, "kv_len": kv_len, "buckets": sorted({int(b) for b in buckets}), "core": core,
            "core_hbm": 16 * GIB, "device_problem": device_problem, "commands": commands,
            "instances": [i.name for i in INSTANCES]}


def render_resource_plan(plan: dict) -> str:
    gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
    lines = [f"resource plan: {plan['instance']} (host {gib(plan['host_bytes'])}; tp={plan['tp']}, one NeuronCore "
             f"of 16 GiB per rank), model {gib(plan['fp32_model_bytes'])} in fp32, buckets {plan['buckets']}, "
             f"KV length {plan['kv_len']}"]
    for name, c in plan["commands"].items():
        host = "fits" if c["fits_host"] else "does NOT fit"
        dev = "fits" if c["fits_device"] else "does NOT fit"
        lines.append(f"  {name:9s} host peak {gib(c['host_peak_bytes'])} ({host}); device "
                     f"{gib(c['device_bytes_per_core'])} per core ({dev}), {c['graphs']} graphs  [{c['host_basis']}]")
    if plan["device_problem"]:
        lines.append(f"  device: {plan['device_problem']}")
    if not all(c["fits_host"] for c in plan["commands"].values()):
        lines.append("  host: a command over the budget has no option that makes it fit yet (streamed references "
                     "and one model resident at a time are issue 28's item 3); a larger instance or "
                     "--host-memory for another host")
    return "\n".join(lines)


__all__ = ["COMMANDS", "HOST_MODEL", "HOST_RAM", "fp32_model_bytes", "render_resource_plan", "resource_plan"]
