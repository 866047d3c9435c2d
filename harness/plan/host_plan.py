"""The resource plan of every command (`info --plan`, and the first line of check, reference,
bisect, quality and bench): peak host memory, device memory per NeuronCore and the number of
compiled graphs, for the model, TP, buckets and KV length asked for, against the instance's host RAM
and HBM.

Device side: harness/plan/instances.py core_bytes (weights, KV cache, graphs, MoE working set, layout
transform). Host side, counted by phase (`host_phases`): what each command holds at once in each
phase (the port's ranks, one transformers reference model at a time, the fp32 stage's port beside
the port, the float64 envelope whole or streamed one layer at a time, the served build, the
captures), and peak = base + k x the largest phase. base and k are fitted per command by
benchmarks/host_plan_fit.py (fresh processes on checkpoints of the 12B's structure at three sizes,
peak RSS per phase); tests/perf/test_host_plan_fit.py holds the plan within 15% of the measured peak
of a size the fit did not see (docs/design.md#resource-plan).
"""

from __future__ import annotations

from harness.base.errors import ShardingError
from harness.inputs.spec import ModelSpec
from harness.plan.instances import INSTANCES, check_fits, core_bytes, smallest_instance
from harness.port.sharding import bytes_per_rank, kv_cache_bytes, layer_params_per_rank

GIB = 1 << 30
HOST_RAM = {"inf2.8xlarge": 128 * GIB, "inf2.24xlarge": 384 * GIB, "inf2.48xlarge": 768 * GIB}  # AWS, Inf2 page
VCPUS = {"inf2.8xlarge": 32, "inf2.24xlarge": 96, "inf2.48xlarge": 192}  # AWS, Inf2 page
COMMANDS = ("check", "reference", "bisect", "quality", "bench")
# command -> (base bytes, k, basis): peak = base + k x the largest counted phase. Fitted by
# benchmarks/host_plan_fit.py (docs/design.md#resource-plan has the runs); bisect, quality and bench
# are not measured apart and take check's constants (the same port, references and stages).
FITTED = {"check": (501_002_364, 1.158, "fit over hidden 512/768/1024 (2026-12-01)"),
          "reference": (494_532_168, 1.062, "fit over hidden 512/768/1024 (2026-12-01)")}
HOST_FIT = {name: FITTED.get(name, (*FITTED["check"][:2], "check's fit")) for name in COMMANDS}
# Copies of the captured rows held at once in check: the port's, the fp32, bf16 and float64
# references', and the judge's stacked device/reference/envelope tensors.
CAPTURE_COPIES = 7


def fp32_model_bytes(spec: ModelSpec) -> int:
    """The text decoder in fp32 as the host holds it: every weight once (tied head), plus the
    per-layer input table of a PLE model."""
    sizes = bytes_per_rank(spec, 1, "float32", 0)
    return sizes["weights"] + spec.per_layer_vocab_size * spec.num_layers * spec.per_layer_input_size * 4


def _default_rows() -> int:
    """Positions the default prompts run (each prompt plus its 8 decoded tokens)."""
    import json

    from harness import FIXTURES_DIR

    prompts = json.loads((FIXTURES_DIR / "prompts" / "default.json").read_text())
    return sum(len(p) + 8 for p in prompts)


def host_parts(spec: ModelSpec, tp: int, dtype: str, backend: str = "neuron", rows: int | None = None,
               assistant=None) -> dict:
    """The pieces a command holds on the host, in bytes: `model` (fp32, one transformers reference),
    `port` (the port's host part: its ranks on cpu/xla, the embedding table on neuron), `load` (the
    per-rank state dicts while a build loads: on neuron they leave for the device), `fp32_port`
    (the fp32 stage's build on cpu), `float64` (the envelope's model: whole, or its embedding plus
    one layer when streamed), `captures` (the captured rows of every copy), `drafters` (with the
    `assistant`: the speculative stage's fp32 drafter on the host and its fp32 and bf16 references)."""
    from harness.reference import float64 as f64  # whole up to its FLOAT64_RESIDENT_BYTES, read now

    model = fp32_model_bytes(spec)
    ranks = lambda d: tp * bytes_per_rank(spec, tp, d, 0)["weights"]  # noqa: E731
    table = lambda d: bytes_per_rank(spec, tp, d, 0)["host_embeddings"]  # noqa: E731
    port = table(dtype) + (0 if backend == "neuron" else ranks(dtype))
    whole = 2 * model
    rows = _default_rows() if rows is None else rows
    streamed = streamed_bytes(spec, 8, rows)
    per_row = 4 * (spec.vocab_size * 3 + spec.num_layers * spec.hidden_size * 4)
    return {"model": model, "port": port, "load": ranks(dtype) if backend == "neuron" else 0,
            # an fp32 port on the host backend is its own fp32 stage (harness/parity/check.py _fp32_stage)
            "fp32_port": 0 if dtype == "float32" and backend != "neuron" else ranks("float32") + table("float32"),
            "float64": whole if whole <= f64.FLOAT64_RESIDENT_BYTES else streamed,
            "float64_streamed": whole > f64.FLOAT64_RESIDENT_BYTES, "stream32": streamed_bytes(spec, 4, rows),
            "captures": CAPTURE_COPIES * rows * per_row,
            # MoE and PLE: the bf16 stage computes the references again along the port's path
            # (harness/parity/observe.py follow_port_path), one transformers model at a time
            "rerun": model if spec.moe is not None or spec.per_layer_input_size else 0,
            "drafters": 0 if assistant is None else (tp * assistant.bytes_per_rank(tp, 4)  # its ranks, then references
                                                     + assistant.bytes_per_rank(1, 4) + assistant.bytes_per_rank(1, 2))}


def streamed_bytes(spec: ModelSpec, nbytes: int, rows: int) -> int:
    """A pass streamed one decoder layer at a time (harness/reference/stream.py) at `nbytes` per
    value: the embedding (the tied head), a PLE model's per-layer table, the layer running and the next one being read, and every
    sequence's state: its hidden rows, the MLP's intermediate rows and its KV cache of every layer
    (the float64 envelope records the cache). Measured: one layer and no state undercounts (the
    H=768 streamed run in docs/design.md#resource-plan)."""
    layer = max(layer_params_per_rank(spec, layer, 1) for layer in spec.layers)
    mlp = max(spec.mlp_size(layer) for layer in spec.layers)
    kv = kv_cache_bytes(spec, 1, "float32")["per_token"] // 4  # values per position, every layer
    state = rows * (4 * spec.hidden_size + 2 * mlp + kv)
    ple = spec.per_layer_vocab_size * spec.num_layers * spec.per_layer_input_size  # E2B/E4B: the table, whole
    return nbytes * (spec.vocab_size * spec.hidden_size + ple + 2 * layer + state)


def host_phases(command: str, parts: dict, *, golden: bool = False, fp32_stage: bool = True,
                served: bool = True, stream: bool = False, batch_stage: bool = True, quantized_copy: int = 0) -> dict:
    """What `command` holds at once in each phase (bytes, before the fit's constants). check runs
    its phases in this order (harness/parity/check.py): the port built, the references (one model
    at a time, none with a golden), the fp32 stage (its cpu build beside the port, then the float64
    envelope), the bf16 stage and local verdicts, the batch stage (a batched parity build, the bf16
    stage's released first; its references are the bf16 stage's), the served build (the parity
    build released), the speculative stage (parity/speculative.py: its fp32 run on cpu, then the
    fp32 target acceptance loads once that build is released). `quantized_copy`: what writing the `--quantize` model's copy holds, before all
    of them (harness/inputs/quantized_checkpoint.py copy_host_bytes; 0 when none is written)."""
    p, m, cap = parts["port"], parts["model"], parts["captures"]
    phases = {"build port": p + parts["load"]}
    if command == "check" and not golden:
        phases["reference"] = p + m + cap // 2
    if command in ("check", "bisect") and fp32_stage:
        phases["fp32 stage"] = p + parts["fp32_port"] + parts["float64"] + cap
    if command in ("check", "bisect"):
        phases["bf16 stage"] = p + cap + parts["rerun"]
    if command in ("check", "bisect") and parts.get("drafters"):  # speculative stage's fp32 run, on the host
        # the fp32 build and drafter run, then go; acceptance loads the fp32 target (m) in their place
        phases["speculative stage"] = p + parts["drafters"] + max(parts["fp32_port"], m) + cap
    if command == "quality":
        phases["port"] = p + cap
    if command == "check" and batch_stage:  # built (p + load), then run as the bf16 stage is
        phases["batch stage"] = p + max(parts["load"], cap + parts["rerun"])
    if command == "check" and served:
        phases["served build"] = p + parts["load"] + cap
    if command == "quality" and not golden:  # the corpus references are streamed (harness/quality/golden.py)
        phases["reference"] = p + parts["stream32"] + cap // 2
    if command == "reference":
        phases = {"reference": (parts["stream32"] if stream else m) + cap // CAPTURE_COPIES}
    if quantized_copy and command in ("check", "bisect", "reference"):
        phases["quantized copy"] = quantized_copy
    return phases


def host_peak(command: str, phases: dict) -> int:
    base, k, _ = HOST_FIT[command]
    return int(base + max(k, 1.0) * counted_peak(phases))  # never less than what the phase holds


def counted_peak(phases: dict) -> int:
    return max(phases.values())


def resource_plan(spec: ModelSpec, tp: int, dtype: str, kv_len: int, buckets, *, sliding_cache: str = "linear",
                  host_bytes: int | None = None, layout: bool = False, backend: str = "neuron",
                  rows: int | None = None, options: dict | None = None, speculate: int = 0,
                  batch: int | None = 1, assistant=None, quantize: str | None = None) -> dict:
    """Per command: host_peak_bytes (and its phases), the builds it compiles (`graphs_by_stage`,
    compile_budget.graphs_by_stage; `graphs` their sum) and their cold-compile minutes, the device
    bytes per core of its largest build (stage_build: a parity or a perf build) and whether every
    build fits (`device_problem`: the first that does not); `host_bytes` is the host budget
    (default: the RAM of the instance the TP degree needs); `options` (golden, fp32_stage, served)
    what the command was asked to skip; `batch` the run's KV slots, or None for a check with its
    batch stage (a check without --batch off neuron; on neuron it is asked for with --batch N); `assistant` an AssistantSpec (its draft graphs and drafter);
    `quantize` the weights' storage on the device (int8: core_fit.weight_bytes)."""
    from harness.plan.calibration import read_calibration
    from harness.plan.compile_budget import compile_minutes, graphs_by_stage

    calibration = read_calibration()  # the first inf2 run's measurements, where one was kept

    inst = smallest_instance(tp)
    budget = host_bytes if host_bytes is not None else HOST_RAM.get(inst.name if inst else "")
    build = dict(buckets=buckets, layout=layout, speculate=speculate, assistant=assistant, quantize=quantize)
    slots = batch or 1
    fits: dict[tuple[int, bool], str | None] = {}  # (KV slots, perf build) -> None, or why it does not fit

    def core(key: tuple[int, bool]) -> dict:
        if key not in fits:
            try:
                check_fits(spec, tp, dtype, kv_len, sliding_cache, **build, batch=key[0], perf=key[1])
                fits[key] = None
            except ShardingError as exc:
                fits[key] = str(exc)
        return core_bytes(spec, tp, dtype, kv_len, sliding_cache, **build, batch=key[0], perf=key[1])

    parts = host_parts(spec, tp, dtype, backend, rows=rows, assistant=assistant)
    weights = core_bytes(spec, tp, dtype, kv_len, sliding_cache, **build)["weights"]
    commands = {}
    for name in COMMANDS:
        # the batch stage runs in a check without --batch (off neuron) or with --batch N > 1
        phases = host_phases(name, parts, **{"batch_stage": batch is None or batch > 1, **(options or {})})
        peak = host_peak(name, phases)
        stages = graphs_by_stage(name, buckets, kv_len, batch=batch if name == "check" else slots,
                                 speculate=speculate, drafts=assistant is not None,
                                 served=(options or {}).get("served", True))
        used = {stage_build(stage, slots) for stage in stages}
        device = max((core(key)["total"] for key in used), default=0)
        problems = [fits[key] for key in sorted(used) if fits[key]]
        commands[name] = {"host_peak_bytes": peak, "host_phases": phases, "host_basis": HOST_FIT[name][2],
                          "fits_host": budget is None or peak <= budget, "device_bytes_per_core": device,
                          "graphs_by_stage": stages, "graphs": sum(stages.values()),
                          "compile": compile_minutes(list(stages.values()), weights, host_bytes=budget,
                                                     cpus=VCPUS.get(inst.name if inst else ""), calibration=calibration),
                          "fits_device": not problems, "device_problem": problems[0] if problems else None}
    device_problem = next((c["device_problem"] for c in commands.values() if c["device_problem"]), None)
    core = core((slots, False))
    return {"instance": inst.name if inst else None, "host_bytes": budget, "fp32_model_bytes": parts["model"],
            "float64_streamed": parts["float64_streamed"], "backend": backend,
            "host_parts": parts, "options": dict(options or {}), "tp": tp, "kv_len": kv_len,
            "buckets": sorted({int(b) for b in buckets}), "batch": batch, "core": core, "quantize": quantize,
            "calibration": calibration,
            "core_hbm": 16 * GIB, "device_problem": device_problem, "commands": commands,
            "instances": [i.name for i in INSTANCES]}


def stage_build(stage: str, slots: int) -> tuple[int, bool]:
    """(KV slots, perf build) of a build compile_budget.graphs_by_stage names: the parity build and the
    batch stage return every row and the captures, the served and bench builds one row of logits."""
    from harness.plan.compile_budget import BATCH_STAGE_SLOTS

    return (BATCH_STAGE_SLOTS if stage == "batch stage" else slots), stage in ("served build", "perf build")


def render_resource_plan(plan: dict) -> str:
    from harness.plan.calibration import describe

    host = "no stated budget" if plan["host_bytes"] is None else gib(plan["host_bytes"])
    lines = [f"resource plan: {plan['instance']} (host {host}; tp={plan['tp']}, one NeuronCore "
             f"of 16 GiB per rank), model {gib(plan['fp32_model_bytes'])} in fp32, buckets {plan['buckets']}, "
             f"KV length {plan['kv_len']}"]
    for name, c in plan["commands"].items():
        host = "fits" if c["fits_host"] else "does NOT fit"
        dev = "fits" if c["fits_device"] else "does NOT fit"
        phase = max(c["host_phases"], key=c["host_phases"].get)
        lines.append(f"  {name:9s} host peak {gib(c['host_peak_bytes'])} ({host}; largest phase: {phase})  "
                     f"[{c['host_basis']}]")
        lines.append("            host phases: " + ", ".join(f"{p} {gib(b)}" for p, b in c["host_phases"].items()))
        if not c["graphs"]:
            lines.append("            device: nothing compiled (the references run on the host)")
            continue
        builds = ", ".join(f"{stage} {n}" for stage, n in c["graphs_by_stage"].items())
        lines.append(f"            device {gib(c['device_bytes_per_core'])} per core, largest build ({dev}); "
                     f"{c['graphs']} graphs = {builds}; cold compile ~{c['compile']['minutes']:.0f} min "
                     f"({c['compile']['per_graph']:g} min per graph: {c['compile']['source']}; "
                     f"{c['compile']['workers_reason']})")
    if plan["device_problem"]:
        lines.append(f"  device: {plan['device_problem']}")
    lines += [f"  {line}" for line in describe(plan["calibration"])]
    for name, c in plan["commands"].items():
        if not c["fits_host"]:
            lines.append(f"  {name}: {what_fits(plan, name)}")
    return "\n".join(lines)


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


# command -> (option, what it drops) that shrink its host peak, in the order they are suggested
SHRINKING = {"check": (("--golden DIR", {"golden": True}), ("--skip-fp32-stage", {"fp32_stage": False}),
                       ("--skip-served-build", {"served": False})),
             "bisect": (("--skip-fp32-stage", {"fp32_stage": False}),),
             "reference": (("--stream", {"stream": True}),)}


def what_fits(plan: dict, command: str) -> str:
    """What would make `command` fit the plan's host budget: the options that drop its largest
    phases (each alone, then together), else a larger host."""
    parts, budget = plan["host_parts"], plan["host_bytes"]
    options = dict(plan.get("options") or {})
    tried = []
    for flag, change in SHRINKING.get(command, ()):
        if all(options.get(k) == v for k, v in change.items()):
            continue
        options.update(change)
        tried.append(flag)
        peak = host_peak(command, host_phases(command, parts, **options))
        if peak <= budget:
            return f"with {' and '.join(tried)} the plan is {gib(peak)}, which fits {gib(budget)}"
    peak = plan["commands"][command]["host_peak_bytes"]
    larger = next((f"; {name} ({gib(ram)}) fits it" for name, ram in HOST_RAM.items() if ram >= peak), "")
    return (f"no option of {command} brings it under {gib(budget)}; run it on a host with more memory "
            f"(--host-memory GIB states that host's budget){larger}")


def refuse_unfit_host(plan: dict, command: str, budget_source: str) -> str | None:
    """The one-line refusal of a command whose host plan does not fit the budget (None: it fits)."""
    c = plan["commands"][command]
    if c["fits_host"]:
        return None
    phase = max(c["host_phases"], key=c["host_phases"].get)
    return (f"{command}: the host plan needs {gib(c['host_peak_bytes'])} at its peak ({phase}), over the host "
            f"budget of {gib(plan['host_bytes'])} ({budget_source}); {what_fits(plan, command)}")


def summary_line(plan: dict, command: str) -> str:
    """The plan's one line for `command`, printed before it starts."""
    c = plan["commands"][command]
    phase = max(c["host_phases"], key=c["host_phases"].get)
    budget = "no stated budget" if plan["host_bytes"] is None else gib(plan["host_bytes"])
    builds = ", ".join(f"{stage} {n}" for stage, n in c["graphs_by_stage"].items()) or "none"
    return (f"plan: host peak {gib(c['host_peak_bytes'])} of {budget} (largest phase: {phase}), "
            f"device {gib(c['device_bytes_per_core'])} per NeuronCore, {c['graphs']} graphs ({builds}), "
            f"cold compile ~{c['compile']['minutes']:.0f} min ({c['compile']['per_graph']:g} min per graph, "
            f"{c['compile']['workers']} at once, {c['compile']['basis']})")


__all__ = ["COMMANDS", "HOST_FIT", "HOST_RAM", "counted_peak", "fp32_model_bytes", "host_parts", "host_peak",
           "host_phases", "refuse_unfit_host", "render_resource_plan", "resource_plan", "summary_line", "what_fits"]
