"""The one stage runner of a parity run: every stage of `check` (the fp32 and bf16 stages, then the
per-layer rows, the bit-exact layers, the distribution, and the served, batch and speculative
stages) is a harness.judge.stage_result.Stage executed here, in the one order `stage_order` holds,
each result sealed into the check's result (harness.judge.check_result.CheckResult.stages)."""

from __future__ import annotations

import gc
import time

# The named inputs a stage may read: the run's labels and options (harness.parity.check.PortRun), the
# checkpoint, the parity build's engine (held until the last stage reading it has run) and the
# references the check observed (harness.parity.observation.StageReferences). A stage reads the
# results of earlier stages by their names (Stage.after).
INPUTS = ("run", "checkpoint", "engine", "references")


def stage_order(stages) -> list:
    """The run order, the one rule: the stages reading the parity build ("engine") first, so that it
    is released before a stage builds its own (a device never holds two builds of the model); then
    the others in the order given, each stage after the stages it reads (`after`; a stage absent
    from the run is not waited for)."""
    stages = list(stages)
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"two stages of one name in {names}")
    pending = sorted(stages, key=lambda s: "engine" not in s.reads)  # stable
    ordered: list = []
    while pending:
        ready = next((s for s in pending if not set(s.after) & {p.name for p in pending}), None)
        if ready is None:
            raise ValueError(f"the stages {[s.name for s in pending]} read each other (after): no order runs them")
        if "engine" in ready.reads and any("engine" not in s.reads for s in ordered):
            raise ValueError(f"the {ready.name} stage reads the parity build after it was released (it reads "
                             f"{list(ready.after)})")
        ordered.append(ready)
        pending.remove(ready)
    return ordered


def run_stages(stages, inputs: dict, into) -> None:
    """Execute `stages` in stage_order: each called with the named inputs it reads and the results of
    the stages it reads, its StageResult sealed and added to `into` (a CheckResult: `stages`, and its
    wall time in `stage_seconds`). The parity build (inputs["engine"]) is dropped from `inputs` once
    the last stage reading it has run: a caller holding it nowhere else releases it there."""
    done: dict = {}
    ordered = stage_order(stages)
    for i, stage in enumerate(ordered):
        missing = [name for name in stage.reads if name not in inputs]
        if missing:
            raise ValueError(f"the {stage.name} stage reads {missing}, not among the run's inputs {sorted(inputs)}")
        start = time.perf_counter()
        out = stage.run(**{name: inputs[name] for name in stage.reads}, **{name: done.get(name) for name in stage.after})
        if out is not None:
            into.stages.append(out.seal())
            done[stage.name] = out
        if "engine" in inputs and not any("engine" in later.reads for later in ordered[i + 1:]):
            del inputs["engine"]
            gc.collect()
        into.stage_seconds[stage.name] = round(time.perf_counter() - start, 2)  # check --verbose prints it


def observed_by(bf16, fp32=None):
    """The observation (harness.parity.observation.StageObservation) a later stage reads the check's
    references from: the bf16 stage's, or the fp32 stage's where the bf16 stage raised before it
    observed the port; None where neither observed it."""
    for stage in (bf16, fp32):
        if stage is not None and stage.observation is not None:
            return stage.observation
    return None
