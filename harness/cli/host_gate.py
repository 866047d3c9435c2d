"""The host plan before a command's model work (issue 28): check, reference, bisect, quality and
bench on a real checkpoint print the plan's one line first, and a run whose plan does not fit
`--host-memory` (default `auto`: this machine's RAM, read from the machine; GIB states another
host's) is refused with exit 2, naming the numbers and the options that would make it fit
(harness/plan/host_plan.py)."""

from __future__ import annotations

import os

from harness.base.errors import OptionError

GIB = 1 << 30


def add_host_memory_arg(p, purpose: str = "a run whose host plan (harness/plan/host_plan.py) does not fit it is "
                                            "refused before model work") -> None:
    """`--host-memory GIB|auto` on every command that takes it (None in args means the default, auto)."""
    p.add_argument("--host-memory", metavar="GIB", type=_host_memory_arg, default=None,
                   help=f"the host memory budget in GiB, or `auto` for this machine's RAM; {purpose} "
                        "(default: auto, what this host has)")


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
    """This machine's physical memory (MemTotal): the `--host-memory` default (`auto`)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise OptionError("--host-memory auto: this system does not report its memory; give the budget "
                          "in GiB (--host-memory GIB)") from None


def budget(args) -> tuple[int, str]:
    """(host budget bytes, where it comes from): --host-memory GIB, else (`auto`, the default) what
    this machine has: a run is judged against the host it runs on, not the instance it might."""
    value = getattr(args, "host_memory", None)
    if value is None or value == "auto":
        said = "--host-memory auto" if value == "auto" else "the default, --host-memory auto"
        return machine_ram_bytes(), f"this machine's RAM ({said}; --host-memory GIB for another host)"
    return int(value * GIB), f"--host-memory {value:g}"


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
    if getattr(args, "quantized_copy", 0):  # counted by quantized_copy_gate, before the copy was written
        options = {**options, "quantized_copy": args.quantized_copy}
    plan = resource_plan(spec, s.tp, s.dtype, s.kv_len, s.buckets, sliding_cache=s.sliding_cache, host_bytes=host,
                         layout=layout, backend=s.backend, rows=rows, options=options, speculate=s.speculate,
                         batch=batch if command == "check" else (batch or 1),
                         assistant=getattr(getattr(args, "assistant_ckpt", None), "spec", None),  # its draft graphs
                         quantize=s.quantize)
    args.resource_plan = plan
    limit = getattr(args, "compile_budget", None)
    if getattr(args, "checkpoint", None) is not None or getattr(args, "host_memory", None) is not None or limit:
        print(f"{command} {summary_line(plan, command)}", flush=True)
    c = plan["commands"][command]
    if s.backend == "neuron":  # every build the run makes is counted against what this plan counted
        from harness.backends.neuron_gate import LEDGER

        LEDGER.state(c["graphs"], f"the plan of `{command}` ({', '.join(f'{k} {n}' for k, n in c['graphs_by_stage'].items())})")
    over = refuse_over_budget(command, c["graphs_by_stage"], c["compile"], limit) if s.backend == "neuron" else None
    if over:
        raise OptionError(over)
    if s.backend == "neuron" and c["device_problem"]:  # the one device fit, before any compile
        raise OptionError(f"{command}: {c['device_problem']}")
    problem = refuse_unfit_host(plan, command, source)
    if problem:
        raise OptionError(problem)
    return plan


def quantized_copy_gate(args, command: str, ckpt) -> None:
    """`--quantize`: the host bytes writing the quantized model's copy holds (once per checkpoint
    and scheme: harness/inputs/quantized_checkpoint.py), kept for the command's plan (its "quantized
    copy" phase), and refused (exit 2) before the copy is written when that phase is over the budget."""
    from harness.inputs.quantized_checkpoint import copy_host_bytes
    from harness.plan.host_plan import gib, host_peak

    args.quantized_copy = copy_host_bytes(ckpt, args.quantize)
    host, source = budget(args)
    peak = host_peak(command, {"quantized copy": args.quantized_copy})
    if args.quantized_copy and peak > host:
        raise OptionError(f"{command} --quantize {args.quantize}: writing the quantized model's copy of {ckpt.path} "
                          f"(once, into the cache) needs {gib(peak)} of host memory at its peak, over the host budget "
                          f"of {gib(host)} ({source}); run it on a host with more memory (--host-memory GIB states "
                          "that host's budget)")


def gated_quantized_reference(args, command: str, ckpt):
    """`--quantize`: quantized_copy_gate, then the quantized model's checkpoint (its copy written
    now when the cache lacks it), the structural reference of check, bisect and reference."""
    from harness.inputs.quantized_checkpoint import quantized_reference

    quantized_copy_gate(args, command, ckpt)
    return quantized_reference(ckpt, args.quantize)


def rows_of(prompts, new_tokens: int) -> int:
    """Positions a run's prompts take, each with its decoded tokens."""
    return sum(len(p) + new_tokens for p in prompts)
