"""The check's prompts served as the sequences of a batch (issue 29, docs/batch.md), each judged
against the reference run of its prompt alone.

- `serve_batch`: the prompts through the one decode loop, a KV slot each (continuous batching),
  admitted longest first (`admission_order`): the first call holds the longest rows side by side
  (every shorter row padded in the same call), and a prompt admitted later takes a slot a longer
  sequence left, whose old keys lie past the new sequence's positions (what a reused slot must hide).
- `run_port_batch`: `check --batch N`'s port runs (observe.observe_stage's `run_prompts`).
- `batch_stage`: the batch stage of a `check` run without `--batch` (one of run_parity_check's
  extra checks): after the batch-1 stages, the prompts as one ragged batch of `stage_slots` KV slots
  through a batched parity build in the run's dtype, observed and judged exactly as the bf16 stage
  (the same references, near-tie band, structural flips and per-layer input pins: no reference is
  run again unless the batch's own routing or pinned values differ, harness/parity/forced_path.py).
  A batch-only fault (a pad key visible, a slot written or read wrongly) fails it naming the
  sequence (`prompt k`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from harness.base.progress import status
from harness.judge.results import ParityStage
from harness.judge.stage import judge_stage, structural_flips
from harness.judge.stage_result import Gate, Stage, StageResult
from harness.parity.observation import PortPrompt
from harness.parity.observe import PortFailure, StageContext, build_port, observe_stage, port_call

# The batch stage's KV slots: one fewer than the prompts (so the last, shortest prompt starts in the
# slot the longest left), at least 2, at most 4 (the batch buckets a device compiles: 1, 2, 4).
MAX_STAGE_SLOTS = 4


def admission_order(prompts: list) -> list[int]:
    """Prompt indices longest first (ties in prompt order)."""
    return sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))


def stage_slots(prompts: int) -> int:
    return max(2, min(MAX_STAGE_SLOTS, prompts - 1))


def serve_batch(engine, prompts: list, wants: list[int], capture: bool = False, forced: list | None = None,
                observe=None) -> list:
    """The one decode loop (harness.port.decode.generate) over `prompts` admitted in
    admission_order; the results in prompt order and `observe(prompt index, slot, written)` called
    with the prompt's own index."""
    from harness.port import decode

    order = admission_order(prompts)
    step = decode.forced([forced[k] for k in order]) if forced is not None else decode.greedy()
    out = decode.generate(engine, [prompts[k] for k in order], [wants[k] for k in order], step, capture=capture,
                          observe=(lambda i, slot, written: observe(order[i], slot, written)) if observe else None)
    results = [None] * len(prompts)
    for k, result in zip(order, out):
        results[k] = result
    return results


def run_port_batch(engine, ref32: list, context: StageContext) -> list[PortPrompt]:
    """Every prompt as a sequence of a batch of engine.settings.batch slots, each read from its own
    KV slot: free greedy decode with captures, which is also the teacher-forced run when every
    sequence chose the reference's tokens (it was fed exactly those); else the teacher-forced run
    as well. Then the host probabilities."""
    phase = f"{context.stage} stage, batch of {engine.settings.batch}"
    say = status(f"port {context.stage}", context.progress)
    say(f"{len(ref32)} prompts as a batch of {engine.settings.batch} sequences, longest first")
    prompts, wants = [r.prompt for r in ref32], [len(r.generated) for r in ref32]
    snaps: list[list] = [[] for _ in ref32]
    observe = ((lambda k, slot, written: snaps[k].append((written, engine.read_cache(written, slot))))
               if engine.backend.reads_cache else None)
    free = port_call(f"{phase}: batched prefill and free greedy decode", serve_batch, engine, prompts, wants,
                     capture=True, observe=observe)
    forced = free
    if any(run.tokens != r.generated for run, r in zip(free, ref32)):
        snaps = [[] for _ in ref32]  # the cache judged along the teacher-forced run
        forced = port_call(f"{phase}: batched prefill and teacher-forced decode", serve_batch, engine, prompts, wants,
                           capture=True, forced=[r.generated for r in ref32], observe=observe)
    say.close()
    return [PortPrompt(f, g, kv, port_call(f"{phase}: host probabilities", engine.probabilities, f.prefill.logits),
                       port_call(f"{phase}: host probabilities", engine.probabilities, f.step_logits))
            for f, g, kv in zip(forced, free, snaps)]


@dataclass
class BatchStage(StageResult):
    """The batch stage of a check run without --batch (a harness.judge.stage_result.StageResult)."""

    stage = "batch"
    ran: bool
    slots: int = 0
    order: list[int] = field(default_factory=list)  # the prompts' admission order
    result: ParityStage | None = None  # the batch judged as the bf16 stage judges (stage "batch")
    notes: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)

    def gates(self) -> list[Gate]:  # the sequences judged as the bf16 stage judges its prompts
        return [Gate("sequences", self.result.failures())] if self.result is not None else []

    def what_ran(self) -> str:
        if not self.ran:
            return "batch stage not run: " + "; ".join(self.notes)
        return (f"batch stage: the {len(self.order)} prompts as one ragged batch of {self.slots} KV slots "
                f"(continuous batching, admitted longest first: prompts {self.order}), each judged against "
                "its prompt alone by the bf16 stage's judge")

    def describe(self) -> str:
        if not self.ran:
            return self.what_ran()
        failures = self.failures()
        lines = [f"{self.what_ran()}: {'FAIL' if failures else 'PASS'}"]
        lines += [f"  {n}" for n in self.notes]
        lines += [f"  {f['point']} at {f.get('where', '?')}" + (f" (ratio {f['ratio']:.2f})" if f.get("ratio") else "")
                  for f in failures[:8]]
        if len(failures) > 8:
            lines.append(f"  ... and {len(failures) - 8} more (the JSON's extra_stages.batch)")
        return "\n".join(lines)

    def payload(self) -> dict:
        out = {"what_ran": self.what_ran(), "slots": self.slots, "admission_order": self.order, "seconds": self.seconds}
        if self.result is not None:  # one entry per sequence under "prompts", as the bf16 stage's
            out.update({k: v for k, v in self.result.stage_json().items()
                        if k not in ("notes", "seconds", "passed", "failures")},
                       stage_notes=self.result.notes, references_rerun=list(getattr(self.result.observation, "rerouted", [])))
        return out


def batch_stage(settings, progress: bool = False, skip: str | None = None) -> Stage:
    """The batch stage for the parity run (parity.stages.run_stages): a function of the fp32 and
    bf16 stages' results and the checkpoint returning the BatchStage; `skip`: why it does not run (said in it)."""
    def stage(checkpoint, fp32=None, bf16=None) -> BatchStage:
        return BatchStage(ran=False, notes=[skip]) if skip else run_batch_stage(bf16, checkpoint, settings, progress, fp32)
    return Stage("batch", stage, after=("fp32", "bf16"))


def run_batch_stage(result: ParityStage, checkpoint, settings, progress: bool = False,
                    fp32: ParityStage | None = None) -> BatchStage:
    """The bf16 stage's prompts and references (as it observed them) through a batched parity build of
    `settings` with stage_slots(prompts) slots, judged in the bf16 stage's context."""
    from harness.backends import backend_class

    observed = result.observation
    if observed is None:
        return BatchStage(ran=False, notes=["the bf16 stage raised before it observed the port"])
    refs = observed.references
    if len(refs.fp32) < 2:
        return BatchStage(ran=False, notes=["one prompt: no batch to serve (give two or more prompts)"])
    if not backend_class(settings.backend).serves_batch:
        return BatchStage(ran=False, notes=[f"the {settings.backend} backend does not serve batches"])
    slots, order = stage_slots(len(refs.fp32)), admission_order([r.prompt for r in refs.fp32])
    context = StageContext("bf16", settings.backend, settings.tp, settings.dtype, calibration=result.calibration,
                           structural=structural_flips(fp32), progress=progress, force_path=observed.followed,
                           pins=[f.inputs for f in observed.forcing])
    start = time.perf_counter()
    try:
        batched = settings.but(batch=slots, assistant=None, speculate=0)  # the stage serves, it does not speculate
        judged = judge_stage(_observe(checkpoint, batched, refs, context), checkpoint.spec, context)
    except PortFailure as failure:
        judged = ParityStage(backend=settings.backend, tp=settings.tp, dtype=settings.dtype,
                             port_error=failure.describe(), calibration=result.calibration)
    if not backend_class(settings.backend).host_ranks:
        gc.collect()  # a device holds one build at a time: this one is gone before the next stage builds
    judged.stage = "batch"
    notes = [f"the references keep the bf16 stage's {len(observed.pinned)} per-layer input pins (pinned again "
             "where the batch's value differs)"] if observed.pinned else []
    return BatchStage(ran=True, slots=slots, order=order, result=judged, notes=notes,
                      seconds={"total": round(time.perf_counter() - start, 2), **judged.seconds})


def _observe(checkpoint, settings, refs, context):
    engine = port_call("batch stage: building the batched parity build", build_port, checkpoint, settings)
    return observe_stage(engine, checkpoint, refs, context, run_port_batch)
