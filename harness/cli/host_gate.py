"""The host plan before a command's model work (issue 28): check, reference, bisect, quality and
bench on a real checkpoint print the plan's one line first, and a run whose plan does not fit
`--host-memory` (default: the RAM of the instance the TP degree needs; `auto`: this machine's) is
refused with exit 2, naming the numbers and the options that would make it fit
(harness/plan/host_plan.py)."""

from __future__ import annotations

import os

from harness.base.errors import OptionError

GIB = 1 << 30


def add_host_memory_arg(p) -> None:
    p.add_argument("--host-memory", metavar="GIB", type=_host_memory_arg, default=None,
                   help="the host memory budget in GiB, or `auto` for this machine's RAM; a run whose host "
                        "plan (harness/plan/host_plan.py) does not fit it is refused before model work "
                        "(default: the RAM of the inf2 instance the TP degree needs)")


def _host_memory_arg(text: str):
    import argparse

    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give the host budget in GiB (a positive number) or `auto`")
    return value


def machine_ram_bytes() -> int:
    """This machine's physical memory (MemTotal), read only for `--host-memory auto`."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise OptionError("--host-memory auto: this system does not report its memory; give the budget "
                          "in GiB") from None


def budget(args) -> tuple[int | None, str]:
    """(host budget bytes or None for the instance default, where it comes from)."""
    value = getattr(args, "host_memory", None)
    if value == "auto":
        return machine_ram_bytes(), "--host-memory auto: this machine's RAM"
    if value is not None:
        return int(value * GIB), f"--host-memory {value:g}"
    return None, "the instance's RAM; --host-memory GIB for another host"


def plan_gate(args, command: str, spec, rows: int | None = None, **options) -> dict:
    """The command's resource plan; printed (one line) on a real checkpoint or when a budget was
    given, and refused (exit 2) when its host peak is over the budget or, on neuron, its cold
    compile over --compile-budget or a build it compiles over a NeuronCore (the device fit)."""
    from harness.base.settings import RunSettings
    from harness.plan.compile_budget import refuse_over_budget
    from harness.plan.host_plan import refuse_unfit_host, resource_plan, summary_line
    from harness.plan.instances import layout_transform

    s = getattr(args, "settings", None) or RunSettings()
    host, source = budget(args)
    layout = layout_transform(s.backend_options)
    batch = getattr(args, "batch", None)  # bench: a list of batch sizes (one build of the largest)
    batch = max(batch) if isinstance(batch, (list, tuple)) and batch else batch if isinstance(batch, int) else 1
    batch = None if options.get("batch_stage") else batch  # check without --batch: batch 1 and its batch stage
    plan = resource_plan(spec, s.tp, s.dtype, s.kv_len, s.buckets, sliding_cache=s.sliding_cache, host_bytes=host,
                         layout=layout, backend=s.backend, rows=rows, options=options, speculate=s.speculate,
                         batch=batch if command == "check" else (batch or 1))
    args.resource_plan = plan
    limit = getattr(args, "compile_budget", None)
    if getattr(args, "checkpoint", None) is not None or getattr(args, "host_memory", None) is not None or limit:
        print(f"{command} {summary_line(plan, command)}", flush=True)
    c = plan["commands"][command]
    over = refuse_over_budget(command, c["graphs_by_stage"], c["compile"], limit) if s.backend == "neuron" else None
    if over:
        raise OptionError(over)
    if s.backend == "neuron" and c["device_problem"]:  # the one device fit, before any compile
        raise OptionError(f"{command}: {c['device_problem']}")
    problem = refuse_unfit_host(plan, command, source)
    if problem:
        raise OptionError(problem)
    return plan


def rows_of(prompts, new_tokens: int) -> int:
    """Positions a run's prompts take, each with its decoded tokens."""
    return sum(len(p) + new_tokens for p in prompts)
