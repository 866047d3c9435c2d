"""One parity run: the port on a backend against the reference (fresh or from a golden), judged
by compare.py's policy in two stages. What `gemma-parity check` and the parity suites execute;
`bisect` (capture mode) runs the same `check_port` and reads its layers from it.

- **fp32 structural stage**: the port in fp32 (on CPU, or on the backend itself when it is cpu/xla)
  must equal the fp32 reference to fp32 precision at every capture point and token for token. A
  structural bug (a wrong activation, rope angles in low precision, a decode-only mask) cannot
  hide inside bf16 noise there.
- **bf16 envelope stage**: the port in its own dtype, judged by the bf16 noise envelope, with the
  near-tie band calibrated from the references' own margins; a flip the fp32 stage also shows is
  never a near tie.
- **local verdicts** (where the backend's ranks run on CPU): each layer alone on the reference's
  input to it, so a failure is attributed to the layer that is itself wrong.

This module declares the fp32 and bf16 stages and lists a check's stages: harness.parity.observe
observes each stage whole (the port, the references, and the references along the port's path),
harness.judge.stage and harness.judge.compare judge it (routing included), harness.parity.local judges
each layer alone beside the stage's observation, and harness.judge.results.ParityStage holds the
stage's result. Every stage (fp32, bf16, the check's own: the per-layer table rows on the parity build,
the bit-exact layers and the distribution of R; the parity run's `stages`: served, batch, speculative)
is a stage_result.Stage (a function of named inputs returning a StageResult) executed by
harness.parity.stages.run_stages, the one runner, in the one order its stage_order holds, into the
check's result (harness.judge.check_result.CheckResult); stage_result.overall_verdict builds the verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from harness.parity.batched import run_port_batch
from harness.parity.host_rows import per_layer_rows_stage
from harness.parity.layer_bits import bitwise_layers_stage
from harness.parity.local import intra_op_threads_for, local_verdicts
from harness.reference.golden import Golden, same_weights
from harness.reference.layers import ReferenceLayers
from harness.parity.observation import StageReferences
from harness.parity.observe import (PortFailure, StageContext, build_fp32_port, build_port, check_fit,
                                    load_reference_source, load_references, observe_stage, port_call)
from harness.base.settings import RunSettings
from harness.judge.distribution import distribution_stage
from harness.judge.check_result import CheckResult
from harness.judge.results import LocalLayer, ParityStage
from harness.judge.stage_result import Stage
from harness.parity.stages import run_stages
from harness.judge.stage import judge_stage, near_tie_calibration, structural_flips
from harness.reference.run import ReferenceResult


def check_stages(strict_precision: bool = False) -> tuple[Stage, ...]:
    """The check's own stages beyond fp32 and bf16: the per-layer table rows and the bit-exact layers
    (on the parity build), and the distribution of R (`strict_precision`: its over-precision, R's, the
    bit-exact layers' and the served build's, fails instead of warning)."""
    return per_layer_rows_stage(), bitwise_layers_stage(), distribution_stage(strict_precision)


@dataclass(frozen=True)
class PortRun:
    """What a check's results are labelled with (the run settings' backend, TP degree and dtype
    name), whether it shows progress, and whether the references may be computed again along the
    port's path (harness/parity/observe.py follow_port_path): not against a golden of other weights, whose
    references this checkpoint cannot reproduce."""

    backend: str
    tp: int
    dtype: str
    progress: bool = False
    force_path: bool = True

    @classmethod
    def of(cls, settings: RunSettings, progress: bool = False, force_path: bool = True) -> "PortRun":
        return cls(settings.backend, settings.tp, settings.dtype, progress, force_path)

    def context(self, stage: str, calibration, structural: dict | None = None) -> StageContext:
        """The context of one stage of this run (the fp32 stage is labelled float32)."""
        dtype = "float32" if stage == "fp32" else self.dtype
        return StageContext(stage, self.backend, self.tp, dtype, calibration=calibration,
                            structural=structural or {}, progress=self.progress, force_path=self.force_path)


def _failed_stage(context: StageContext, failure: PortFailure, refs: StageReferences | None = None) -> ParityStage:
    calibration = context.calibration if context.stage == "bf16" else None
    return ParityStage(backend=context.backend, tp=context.tp, dtype=context.dtype, stage=context.stage,
                       port_error=failure.describe(), calibration=calibration, references=refs)


def run_stage(engine, checkpoint, refs: StageReferences, context: StageContext) -> ParityStage:
    """Observe the port for one stage (the prompts as a batch on a batched engine) and judge it."""
    obs = observe_stage(engine, checkpoint, refs, context, run_port_batch if engine.settings.batch > 1 else None)
    start = time.perf_counter()
    result = judge_stage(obs, checkpoint.spec, context)
    if engine.settings.batch > 1:
        result.notes.append(f"{context.stage} stage: the prompts ran as a batch of {engine.settings.batch} sequences "
                            "(a KV slot each, continuous batching, admitted longest first); each judged against its "
                            "prompt alone")
    result.seconds["judge"] = round(time.perf_counter() - start, 2)
    return result


def _fp32_stage(checkpoint, engine, fp32_engine, refs: StageReferences, context: StageContext) -> ParityStage:
    """fp32_engine: the fp32 engine, or "auto" to build it beside the port's `engine`."""
    try:
        if fp32_engine == "auto":
            start = time.perf_counter()
            fp32_engine = engine if engine.settings.dtype == "float32" else build_fp32_port(checkpoint, engine.settings)
            built = round(time.perf_counter() - start, 2)
        else:
            built = 0.0
        result = run_stage(fp32_engine, checkpoint, refs, context)
        result.seconds["build"] = built
        return result
    except PortFailure as failure:
        return _failed_stage(context, failure, refs)


def structural_stage(checkpoint, refs: StageReferences | tuple, settings: RunSettings,
                     progress: bool = False) -> ParityStage:
    """The fp32 stage alone (what truncate-mode bisect adds): the port in fp32 on the host backend
    against the fp32 reference."""
    refs = StageReferences(*refs)
    context = PortRun.of(settings, progress).context("fp32", near_tie_calibration(*refs))
    check_fit(checkpoint.spec, settings, refs.fp32)
    try:
        engine = build_fp32_port(checkpoint, settings)
    except PortFailure as failure:
        return _failed_stage(context, failure)
    return _fp32_stage(checkpoint, engine, engine, refs, context).seal()


def _local(result: ParityStage, checkpoint, layer_backend, progress: bool) -> None:
    """Each layer alone on the reference's input, beside the stage's observation and its judged
    cumulative layers (the references the stage was judged against: on MoE models, on the port's
    routing)."""
    start = time.perf_counter()
    result.reference_layers = ReferenceLayers(checkpoint)
    verdicts, nonfinite = port_call("bf16 stage: local layer verdicts", lambda: local_verdicts(
        checkpoint, layer_backend, result.observation, result.layers, progress=progress, reference=result.reference_layers))
    result.local_verdicts, result.local_nonfinite = verdicts, nonfinite
    # a layer that cannot run alone (a per-layer input, a shared KV cache) has no local verdict: its
    # row's local column stays empty rather than repeat its cumulative ratio (tiny-e2b: every layer)
    result.local = [LocalLayer(index=v.index, passed=v.passed, component=v.component,
                               ratio=max(p.required_factor for p in v.local), rel_l2=v.local[-1].rel_l2,
                               envelope_rel_l2=v.local[-1].envelope_rel_l2) for v in verdicts if v.local]
    result.seconds["local"] = round(time.perf_counter() - start, 2)


def check_port(checkpoint, engine, ref32: list[ReferenceResult], ref16: list[ReferenceResult],
               local: bool | None = None, progress: bool = False, fp32_engine="auto", layer_backend=None,
               force_path: bool = True, strict_precision: bool = False, stages: tuple[Stage, ...] = ()) -> CheckResult:
    """Both stages: the fp32 structural stage (`fp32_engine`: "auto" builds it, None skips it),
    then the bf16 envelope stage on `engine` with flips the fp32 stage shows marked structural,
    plus (by default wherever the backend's ranks run on CPU; `layer_backend` runs them elsewhere)
    the local verdict of every layer, then the check's own stages (check_stages) and `stages`. An
    exception inside the port is a failed result naming where it was raised. The result is labelled
    with the engine's run settings. `force_path` False: the references are not computed again (a
    golden of other weights)."""
    return _check_port(checkpoint, {"engine": engine}, StageReferences(ref32, ref16),
                       PortRun.of(engine.settings, progress, force_path),
                       options=dict(local=local, fp32_engine=fp32_engine, layer_backend=layer_backend),
                       stages=check_stages(strict_precision) + tuple(stages))


def _check_port(checkpoint, held: dict, refs: StageReferences, run: PortRun, *, options: dict,
                stages: tuple[Stage, ...]) -> CheckResult:
    """`held`: {"engine": the parity build}, its only holder, so that run_stages releases it before a
    stage builds its own."""
    check_fit(checkpoint.spec, held["engine"].settings, refs.fp32)  # no local name: held stays the only holder
    result = CheckResult(backend=run.backend, tp=run.tp, dtype=run.dtype)
    held.update(run=run, checkpoint=checkpoint, references=refs)
    calibration = near_tie_calibration(*refs)  # the token band of both stages, from the references alone
    # every stage on the same intra-op threads (small models run faster on one): a reference layer run
    # the local verdicts kept for the bit-exact stage is the run that stage would make
    with intra_op_threads_for(checkpoint.spec):
        run_stages(parity_stages(calibration, **options) + tuple(stages), held, into=result)
    held.clear()
    return result


def parity_stages(calibration, local: bool | None, fp32_engine, layer_backend) -> tuple[Stage, ...]:
    """The fp32 stage (`fp32_engine`: "auto" builds it beside the parity build, None skips the stage)
    and the bf16 stage on the parity build, with the local verdicts (`local` None: wherever the
    backend's ranks run on CPU; `layer_backend` runs them elsewhere)."""
    def fp32(run, checkpoint, engine, references):
        return _fp32_stage(checkpoint, engine, fp32_engine, references, run.context("fp32", calibration))

    def bf16(run, checkpoint, engine, references, fp32=None):
        context = run.context("bf16", calibration, structural_flips(fp32))
        return _bf16_stage(checkpoint, engine, references, context, fp32,
                           options=dict(local=local, layer_backend=layer_backend))

    reads = ("run", "checkpoint", "engine", "references")
    return (() if fp32_engine is None else (Stage("fp32", fp32, reads),)) + (Stage("bf16", bf16, reads, after=("fp32",)),)


def _bf16_stage(checkpoint, engine, refs: StageReferences, context: StageContext, fp32: ParityStage | None,
                options: dict) -> ParityStage:
    """The bf16 stage observed and judged (flips the fp32 stage shows are structural: `context`), with
    the local verdicts."""
    local, layer_backend = options["local"], options["layer_backend"]
    try:
        result = run_stage(engine, checkpoint, refs, context)
        layer_backend = layer_backend or (engine.backend if engine.backend.host_ranks else None)
        if local is None:
            local = layer_backend is not None
        if local:
            _local(result, checkpoint, layer_backend or engine.backend, context.progress)
        else:
            result.notes.append("local (reference-fed) layer verdicts need the CPU backend's ranks; "
                                "run `gemma-parity bisect` to pin a layer on this backend")
    except PortFailure as failure:
        result = _failed_stage(context, failure, refs)
    if fp32 is None:
        result.notes.append("fp32 structural stage skipped")
    return result


def run_parity_check(checkpoint, checkpoint_dir, settings: RunSettings, golden=None, prompts=None,
                     new_tokens: int = 8, progress: bool = False, fp32_stage: bool = True,
                     stages: tuple[Stage, ...] = (), strict_precision: bool = False) -> CheckResult:
    """What `gemma-parity check` does: the port run as `settings` say against the reference
    (recomputed for `prompts`, or read from `golden`), judged in two stages, then the check's own
    stages and `stages` (served, batch, speculative: each builds its own engine, after the parity
    build is released, so a device never holds two builds of the model at once)."""
    start = time.perf_counter()
    source = load_reference_source(checkpoint, checkpoint_dir, golden, prompts)
    check_fit(checkpoint.spec, settings, list(getattr(source, "prompts", source)),
              getattr(source, "new_tokens", new_tokens))
    # The backend before the reference: a missing SDK or a bad TP degree is reported before minutes
    # of reference work, and loading the shards checks every weight for NaN/Inf (Checkpoint.get)
    # before transformers (which does not) computes the reference.
    held = {"engine": build_port(checkpoint, settings)}  # its only holder: run_stages releases it
    built = time.perf_counter()
    ref32, ref16 = load_references(source, checkpoint, new_tokens, progress)
    referenced = time.perf_counter()
    # a golden of other weights cannot be re-run along the port's path (harness/parity/observe.py follow_port_path)
    force_path = not isinstance(source, Golden) or same_weights(source, checkpoint) is not False
    result = _check_port(checkpoint, held, StageReferences(ref32, ref16), PortRun.of(settings, progress, force_path),
                         options=dict(local=None, fp32_engine="auto" if fp32_stage else None, layer_backend=None),
                         stages=check_stages(strict_precision) + tuple(stages))
    result.run_seconds.update(build=round(built - start, 2), reference=round(referenced - built, 2),
                              total=round(time.perf_counter() - start, 2))
    return result
