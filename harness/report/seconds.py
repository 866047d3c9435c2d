"""`check --verbose`: the wall time of every phase and stage of the run, down to what none of them
accounts for, and of the command around the run (the JSON holds the same under `seconds`)."""

from __future__ import annotations


def _parts(name: str, parts: dict) -> str:
    return f"time, {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())


def seconds_lines(seconds: dict) -> list[str]:
    """run: build, reference, total (and the command's before/command); fp32 and bf16: their phases;
    stages: each extra stage (harness/parity/stages.py run_stages)."""
    run, stages = dict(seconds.get("run") or {}), seconds.get("stages") or {}
    before, command = run.pop("before", None), run.pop("command", None)
    lines = [_parts("run", run)] if run else []
    lines += [_parts(stage, seconds[stage]) for stage in ("fp32", "bf16") if seconds.get(stage)]
    if stages:
        lines.append(_parts("stages", stages))
    if "total" in run:
        counted = (run.get("build", 0) + run.get("reference", 0) + sum(stages.values())
                   + sum(sum((seconds.get(s) or {}).values()) for s in ("fp32", "bf16")))
        lines.append(f"time, rest of the run: {run['total'] - counted:.1f} s (its total less every line above)")
    if command is not None and before is not None and "total" in run:
        lines.append(f"time, command: {command:.1f} s from after its imports to the verdict = {before:.1f} s before "
                     f"the run (input checks, the reference's self-check) + the run + "
                     f"{command - before - run['total']:.1f} s writing the outputs")
    return lines
