"""The stage protocol: what every extra stage of `check` (served, batch, speculative, and any later
one) returns, and the one function that builds the overall verdict.

A stage (`Stage`) is a function of named inputs (harness.parity.stages.INPUTS, and the results of
the stages it reads) returning a `StageResult`: its `stage` name, whether it `ran`, its notes, and
its named gates (`Gate`: one verdict each, with the failures it found). The failures are computed
once, when the stage is sealed (`seal`, by the parity run that executed it); `to_json` only writes
what was computed. The fp32 and bf16 stages are stages like the others (harness.judge.results.
ParityStage); harness.parity.stages.run_stages, the one runner, executes them all in the one order
its stage_order holds. A later gate (e.g. a distributional gate) joins a stage with `add_gate`
before the seal, and counts in the verdict and the JSON like the stage's own.

`overall_verdict` builds the check's verdict from its one list of stages and holds the local-versus-cumulative rule (`blame`): a layer's local verdict (the
layer alone on the reference's input) decides over its cumulative points, a layer failing only
cumulatively while passing alone carries upstream error, and the fp32 stage names an earlier
layer than the bf16 stage when bf16 noise hides a structural error there.

A tie band travels with its judge (`Ties`): a stage classifying token departures takes one
`Ties`, so a band calibrated for the bf16 envelope is never paired with the fp32 judge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from harness.judge.compare import StageJudge


@dataclass(frozen=True)
class Ties:
    """A judge and the tie band its departures are classified by: the calibrated band for a judge
    that ties within the envelope (bf16), none for one that ties within its own rounding (fp32)."""

    judge: StageJudge
    band: float


def ties(judge: StageJudge, calibration) -> Ties:
    """The band `judge` takes from the check's near-tie calibration (None: no calibration)."""
    return Ties(judge, calibration.band if calibration is not None and judge.envelope_ties else 0.0)


@dataclass
class Gate:
    """One named verdict of a stage: the failures it found (none: it passes) and what it reports."""

    name: str
    failures: list[dict] = field(default_factory=list)
    report: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "failures": self.failures, **self.report}


class StageResult:
    """The protocol of a stage's result, its fields declared here: a subclass sets `stage` (its name),
    `ran` (False: it did not apply, its notes say why) and `notes`, and implements `gates()` (its own
    named verdicts), `payload()` (its JSON beyond the protocol's keys) and `describe()`."""

    stage: str = "stage"
    ran: bool = True
    notes: list[str]
    _sealed: list[Gate] | None = None  # the gates, computed once (seal)
    _added: tuple[Gate, ...] = ()  # gates from outside the stage (add_gate)

    def gates(self) -> list[Gate]:
        return []

    def payload(self) -> dict:
        return {}

    def add_gate(self, gate: Gate) -> None:
        """A gate from outside the stage (the extension point), judged with the stage's own."""
        if self._sealed is not None:
            raise RuntimeError(f"the {self.stage} stage is sealed: add gates before the parity run seals it")
        self._added = (*self._added, gate)

    def seal(self) -> "StageResult":
        """Compute the gates, and so the failures, once."""
        if self._sealed is None:
            self._sealed = [*self.gates(), *self._added]
        return self

    def all_gates(self) -> list[Gate]:
        return self.seal()._sealed

    def failures(self) -> list[dict]:
        return [f for g in self.all_gates() for f in g.failures]

    @property
    def passed(self) -> bool:
        return not self.failures()

    def to_json(self) -> dict:
        return {"ran": self.ran, "passed": self.passed, "failures": self.failures(), "notes": self.notes,
                "gates": [g.to_json() for g in self.all_gates()], **self.payload()}


@dataclass(frozen=True)
class Stage:
    """One stage as the parity run executes it (harness.parity.stages.run_stages): its `name`, the
    function `run`, the named inputs it `reads` (harness.parity.stages.INPUTS: passed by name) and
    the stages it reads `after` (their StageResults, by name: "bf16" for the bf16 stage's finished
    result; None where the run has no such stage). `run` returns a StageResult, or None where the
    stage does not apply to the model (nothing is recorded)."""

    name: str
    run: Callable[..., "StageResult | None"]
    reads: tuple[str, ...] = ("checkpoint",)
    after: tuple[str, ...] = ()


class Verdict(NamedTuple):
    passed: bool
    failed_stages: list[str]
    failures: list[dict]  # every stage's, in order: fp32, bf16, the extra stages
    divergent: tuple[int, str] | None  # (first divergent layer, component)


def blame(cumulative_pass: bool, local) -> dict:
    """The local-versus-cumulative rule for one layer's row: with a local verdict, the layer passes
    or fails alone; failing only cumulatively while passing alone, it carries upstream error."""
    if local is None:
        return {}
    return {"pass": local.passed, "component": local.component, "carries_upstream_error": local.passed and not cumulative_pass}


def divergent(stage, fp32=None) -> tuple[int, str] | None:
    """The first divergent (layer, component) of a bf16 or fp32 stage result (harness.judge.results.
    ParityStage): the first failing local verdict where there are any, else the stage's first failing
    layer point; the `fp32` stage's when it names an earlier layer (a structural error bf16 noise
    hides until later) or the stage names none."""
    own = None
    if stage is not None:
        local = next((v for v in stage.local or [] if not v.passed), None)
        own = (local.index, local.component) if local is not None else stage.first_layer_failure()
    structural = divergent(fp32) if fp32 is not None else None
    if own is None or (structural is not None and structural[0] < own[0]):
        return structural
    return own


def overall_verdict(stages: list[StageResult]) -> Verdict:
    """The check's verdict from its one list of sealed stages (run order: the fp32 stage, the bf16
    stage, the extra ones): every stage passes, with the failures in run order and the first
    divergent layer (the fp32 and bf16 stages', `divergent`)."""
    failed = [s.stage for s in stages if not s.passed]
    failures = [f for s in stages for f in s.failures()]
    named = {s.stage: s for s in stages}
    return Verdict(not failed, failed, failures, divergent(named.get("bf16"), named.get("fp32")))
