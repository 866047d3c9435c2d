"""The served build judged: the perf build `bench` times (built by the same function) runs free
greedy decode on every prompt of `check`, and what it produced is judged against the reference
and against the parity build's own tokens.

Why a second build: the parity build returns every row's logits and every layer's captures as
extra graph outputs; the perf build returns one row and nothing else. On a compiler a graph
change alone can move numerics (a near tie flips at a different step), and a fault can live only
in the perf graph (its last-row gather, its lm_head slice). MLPerf's audit test TEST01 checks the
same thing: the performance run's outputs must match the accuracy run's.

What is judged, per prompt:
- the step logits (the last row at prefill, then each decode step) while the served build's prefix
  is still the reference's: against the fp32 reference by the bf16 envelope (compare_point);
- its first token that departs from the reference: a near tie (the check's calibrated band), a
  saturation tie, or a real divergence, by the check's own departure classifier
  (tokens.classify_departure, with the bf16 stage's judge: served keeps no classifier of its own);
- its tokens against the parity build's: a difference is reported as "the served build differs
  from the judged build at prompt k step s" (a failure when the served choice is a divergence).
"""

from __future__ import annotations

import math
import traceback
from dataclasses import asdict, dataclass, field

import torch

from harness.base.progress import status
from harness.judge.compare import BF16, PointResult, compare_point
from harness.judge.tokens import classify_departure
from harness.judge.verdicts import TokenVerdict
from harness.judge.stage import near_tie_calibration
from harness.judge.stage_result import Gate, Stage, StageResult, Ties, ties
from harness.parity.batched import serve_batch
from harness.parity.stages import observed_by

SKIPPED_NOTE = "served build not judged (--skip-served-build): the perf build bench times was not run"
SAME_CODE_NOTE = ("on the {backend} backend the perf build is the same code as the parity build (the backend "
                  "has no separate perf graphs); the served check still ran it as bench builds it")


@dataclass
class ServedPrompt:
    """One prompt through the served build."""

    tokens: list[int]
    reference_tokens: list[int]
    parity_tokens: list[int] | None  # the parity build's free run (None: it did not run)
    departure: TokenVerdict | None = None  # the first step departing from the reference, classified
    differs_from_parity_at: int | None = None

    @property
    def accounted(self) -> bool:
        return self.departure is None or self.departure.accounted

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "reference_tokens": self.reference_tokens,
                "parity_build_tokens": self.parity_tokens, "seq_match": self.tokens == self.reference_tokens,
                "departure": asdict(self.departure) if self.departure else None,
                "differs_from_parity_build_at": self.differs_from_parity_at, "accounted": self.accounted}


@dataclass
class ServedResult(StageResult):
    """The served-build stage of `check` (a harness.judge.stage_result.StageResult)."""

    stage = "served"
    backend: str
    ran: bool
    same_code: bool = False
    last_row_only: bool = False  # the build's prefill returns only the last real row (a compiled perf build)
    batch: int = 1  # the sequences the perf build served at once (KV slots; 1: one prompt at a time)
    prompts: list[ServedPrompt] = field(default_factory=list)
    step_logits: PointResult | None = None  # every step on the reference's prefix, stacked over prompts
    row_labels: list[str] = field(default_factory=list, repr=False)
    error: dict | None = None  # an exception raised inside the served build
    notes: list[str] = field(default_factory=list)

    def gates(self) -> list[Gate]:
        if self.error:
            return [Gate("error", [dict(self.error, stage="served", point="exception inside the served build")])]
        return [Gate("step_logits", self._logit_failures()), Gate("tokens", self._token_failures())]

    def _logit_failures(self) -> list[dict]:
        out = []
        if self.step_logits is not None and not self.step_logits.passed:
            row = self.step_logits.worst_position
            where = self.row_labels[row] if 0 <= row < len(self.row_labels) else f"row {row}"
            out.append({"stage": "served", "point": "served build step logits", "where": where,
                        "ratio": _finite(self.step_logits.required_factor),
                        "detail": "the served build's logits are outside the bf16 envelope of the reference"})
        return out

    def _token_failures(self) -> list[dict]:
        out = []
        for k, p in enumerate(self.prompts):
            if p.accounted:
                continue
            d = p.departure
            where = f"prompt {k} step {d.position}"
            if p.differs_from_parity_at is not None:
                where += f"; the served build differs from the judged build at prompt {k} step {p.differs_from_parity_at}"
            out.append({"stage": "served", "point": "served build token", "where": where, "detail": d.evidence})
        return out

    def describe(self) -> str:
        if not self.ran:
            return "served build: " + "; ".join(self.notes or [SKIPPED_NOTE])
        batch = f", a batch of {self.batch} sequences" if self.batch > 1 else ""
        lines = [f"served build ({self.backend}, {'last row only' if self.last_row_only else 'all rows'}{batch}): "
                 f"{'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  {n}" for n in self.notes]
        lines += [f"  {f['point']} at {f.get('where', '?')}: {f.get('detail', f.get('message', ''))}"
                  for f in self.failures()]
        return "\n".join(lines)

    def payload(self) -> dict:
        return {"backend": self.backend,
                "same_code_as_parity_build": self.same_code, "last_row_only": self.last_row_only, "batch": self.batch,
                "built_by": "harness.perf.bench.perf_engine (as `bench` builds it)",
                "step_logits": asdict(self.step_logits) if self.step_logits else None,
                "prompts": [p.to_json() for p in self.prompts], "error": self.error}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _error(phase: str, exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "unknown"
    return {"phase": phase, "type": type(exc).__name__, "message": str(exc), "where": where}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def judge_served(runs: list, ref32: list, ref16: list, parity_tokens: list | None,
                 tie: Ties) -> tuple[list[ServedPrompt], PointResult | None, list[str]]:
    """`runs`: the served build's DecodeResult per prompt. Returns the per-prompt verdicts (each
    departure classified by tokens.classify_departure with `tie`'s judge and band, as the check's stage does) and
    the step logits on the reference's prefix judged by the bf16 envelope (with a label per row)."""
    prompts, dev, ref, env, labels = [], [], [], [], []
    for k, (run, r32, r16) in enumerate(zip(runs, ref32, ref16)):
        departure = classify_departure(r32, run, tie.band, judge=tie.judge)
        same = len(r32.generated) if departure is None else departure.position + 1  # rows on the same prefix
        same = min(same, run.step_logits.shape[0], len(r32.generated))
        dev.append(run.step_logits[:same])
        ref.append(r32.step_logits[:same])
        env.append(r16.step_logits[:same])
        labels += [f"prompt {k} step {s} (position {len(r32.prompt) + s - 1})" for s in range(same)]
        theirs = parity_tokens[k] if parity_tokens is not None and k < len(parity_tokens) else None
        differs = _first_difference(theirs, run.tokens) if theirs is not None else None
        prompts.append(ServedPrompt(run.tokens, r32.generated, theirs, departure, differs))
    point = None
    if labels:
        point = compare_point("served.step_logits", torch.cat(dev), torch.cat(ref), torch.cat(env))
    return prompts, point, labels


def check_served_build(checkpoint, ref32: list, ref16: list, parity_result=None, *, settings=None,
                       progress: bool = False, skip: bool = False) -> ServedResult:
    """Build the perf build exactly as `bench` does, run free greedy decode on every reference
    prompt, judge it (judge_served). `parity_result`: the check's result (its bf16 stage's tokens
    and calibrated near-tie band); None judges against the reference alone."""
    from harness.base.settings import RunSettings

    settings = settings or RunSettings()
    backend = settings.backend
    if skip:
        return ServedResult(backend=backend, ran=False, notes=[SKIPPED_NOTE])
    calibration = getattr(parity_result, "calibration", None) or near_tie_calibration(ref32, ref16)
    prompts_run = getattr(parity_result, "prompts", None)
    parity_tokens = [p.device_tokens for p in prompts_run] if prompts_run else None
    say = status(f"{backend} served build", progress, total=len(ref32) + 1)
    say("building the perf build as bench builds it")
    try:
        engine, runs, served_notes, batch = serve_prompts(checkpoint, settings, ref32, say)
    except Exception as exc:  # anything the served build raises is the served build's failure
        return ServedResult(backend=backend, ran=True, error=_error("served build: build and free greedy decode", exc))
    finally:
        say.close()
    prompts, point, labels = judge_served(runs, ref32, ref16, parity_tokens, ties(BF16, calibration))
    same_code = getattr(engine.backend, "name", backend) == "cpu"
    last_row = bool(getattr(engine.backend, "last_row_only", False))
    notes = ([SAME_CODE_NOTE.format(backend=backend)] if same_code else []) + served_notes
    for k, p in enumerate(prompts):
        if p.differs_from_parity_at is not None and p.accounted:
            notes.append(f"the served build differs from the judged build at prompt {k} step "
                         f"{p.differs_from_parity_at} ({p.departure.kind if p.departure else 'the parity build departed'}: accounted)")
    return ServedResult(backend=backend, ran=True, same_code=same_code, last_row_only=last_row, prompts=prompts,
                        step_logits=point, row_labels=labels, notes=notes, batch=batch)


def serve_prompts(checkpoint, settings, ref32: list, say) -> tuple:
    """Free greedy decode of every reference prompt on the perf build made as `bench` makes it ->
    (engine, DecodeResult per prompt, notes). With settings.batch > 1 the prompts are served as the
    sequences of a batch (harness/parity/batched.py serve_batch: continuous batching, longest first)
    where the backend builds a batched perf build (one engine of settings.batch KV slots); else,
    and said in the notes, one prompt at a time."""
    from harness.base.errors import HarnessInputError
    from harness.perf.bench import perf_engine
    from harness.port.decode import generate

    wants = [len(r.generated) for r in ref32]
    try:
        engine = perf_engine(checkpoint, settings)
        batch, why = settings.batch > 1, None
    except HarnessInputError as exc:  # the backend's own refusal of a batched perf build
        if settings.batch == 1:
            raise
        engine, batch, why = perf_engine(checkpoint, settings.but(batch=1)), False, str(exc)
    if batch:
        say(f"{len(ref32)} prompts as a batch of {settings.batch} sequences: free greedy decode")
        return engine, serve_batch(engine, [r.prompt for r in ref32], wants), [
            f"the perf build served the prompts as a batch of {settings.batch} sequences (a KV slot each, "
            "continuous batching, admitted longest first)"], settings.batch
    say(f"{len(ref32)} prompts one at a time: free greedy decode")
    runs = generate(engine, [r.prompt for r in ref32], wants)  # one slot: each prompt in turn
    return engine, runs, [] if why is None else [f"--batch {settings.batch}: the perf build served one prompt at a "
                                                 f"time ({why})"], 1


def served_stage(settings, progress: bool = False, skip: bool = False) -> Stage:
    """The served-build stage for the parity run (harness.parity.stages.run_stages): a
    function of the fp32 and bf16 stages' results and the checkpoint returning the ServedResult, the perf build
    judged on the references the check observed."""
    def stage(checkpoint, fp32=None, bf16=None) -> ServedResult:
        observed = observed_by(bf16, fp32)
        if observed is None and not skip:  # the port raised before any stage observed it: already failed
            return ServedResult(backend=settings.backend, ran=False, notes=[
                "served build not judged: no stage of the check observed the port (it raised first)"])
        refs = observed.references if observed is not None else ([], [])
        return check_served_build(checkpoint, *refs, bf16, settings=settings, progress=progress, skip=skip)
    return Stage("served", stage, after=("fp32", "bf16"))
