"""First divergent layer: which layer of the port breaks parity with a golden, which part, and why.

Two modes (extra graph outputs change what the compiler builds, so a device may need the second):

- capture (CPU): the same run and judgement as `check` (harness.parity.check.check_port) gives every
  layer's cumulative error against the golden, and the token counts, by construction the same.
  Each layer is then also run alone on the golden's input to it (Polygraphy's `debug reduce` idea:
  feed reference intermediates to the piece under test), which gives its *local* error: a layer
  that is itself wrong is told apart from error accumulated upstream. The first divergent layer is
  the first whose local error breaks compare.py's policy; its inner residual points name the
  component.
- truncate (devices): harness.parity.truncate binary-searches builds of the first k layers.
"""

from __future__ import annotations

from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.parity.bisect_result import BisectResult, fp32_summary
from harness.parity.local import final_norm_alone, first_nonfinite, intra_op_threads_for
from harness.reference.layers import ReferenceLayers
from harness.parity.truncate import (PrefixBuild, PrefixCheckpoint, backend_prefix_build, bisect_truncate,  # noqa: F401
                                     first_failing_prefix)

MODES = ("capture", "truncate")


# ---- capture mode: the check's run, each layer alone on the golden's inputs --------------------

def bisect_capture(checkpoint, engine, refs, layer_backend=None, run: dict | None = None) -> BisectResult:
    """Capture mode: `check_port` on `engine` (any backend) against the golden's references
    (harness.parity.observation.StageReferences: fp32, bf16), with the local verdicts run by `layer_backend` (a CPU backend; the engine's own on
    cpu); run = check_port's keyword options (progress, fp32_engine). Every
    count and the first divergent layer are the check's."""
    from harness.parity.check import check_port

    run = dict(run or {})
    with intra_op_threads_for(checkpoint.spec):
        check = check_port(checkpoint, engine, *refs, local=True, layer_backend=layer_backend, **run)
        reference = ReferenceLayers(checkpoint)
        golden_caps = [r.captures for r in refs[0]]
        final = [check.bf16.final_norm, final_norm_alone(layer_backend or engine.backend, reference, golden_caps)]
    return _capture_result(checkpoint.spec, check, refs, final)


def _capture_result(spec, check, refs: tuple, final_norm: list) -> BisectResult:
    lengths = [len(r.prompt) for r in refs[0]]
    bf16 = check.bf16
    captures = bf16.observation.dev if bf16.observation is not None else {}
    nonfinite = first_nonfinite(spec, captures, lengths) if captures else None
    if nonfinite:
        nonfinite["where"] = "port run"
    elif bf16.local_nonfinite:
        nonfinite = dict(bf16.local_nonfinite, where="layer alone on the golden's input")
    notes = []
    if check.backend != "cpu":
        notes.append(f"cumulative errors come from the {check.backend} parity build; local runs use the port's "
                     "layer code on the CPU backend, so a compiler fault shows only as cumulative "
                     "error: use --mode truncate to pin it on the device")
    stage = None if check.fp32 is None else fp32_summary(check.fp32)
    return BisectResult(mode="capture", backend=check.backend, tp=check.tp, dtype=check.dtype,
                        num_layers=spec.num_layers, layers=bf16.local_verdicts, builds=1, nonfinite=nonfinite,
                        seq_match=check.seq_match if any(r.generated for r in refs[0]) else None,
                        near_tie_flips=bf16.near_ties, real_divergences=bf16.divergences, notes=notes,
                        prompt_lengths=lengths, embeddings=bf16.embeddings,
                        final_norm=[p for p in final_norm if p is not None], fp32_stage=stage, check=check)


# ---- the library entry point ------------------------------------------------------------------------------------

def run_bisect(checkpoint, golden, settings: RunSettings = RunSettings(), mode: str | None = None, *,
               build: PrefixBuild | None = None, progress: bool = False, fp32_stage: bool = False,
               strict_precision: bool = False) -> BisectResult:
    """Bisect `checkpoint` (run as `settings` say) against a golden read for the checkpoint's spec.
    The golden may come from other weights (yesterday's): only the architecture must match. Capture
    mode runs the check's stages (the fp32 one when `fp32_stage`)."""
    from harness.parity.observation import StageReferences
    from harness.parity.observe import build_port, layer_backend as cpu_layers

    backend, buckets = settings.backend, settings.buckets
    mode = mode or ("capture" if backend == "cpu" else "truncate")
    if mode not in MODES:
        raise HarnessInputError(f"unknown bisect mode {mode!r}; choose one of {MODES}")
    ref32, ref16 = golden.results("float32"), golden.results("bfloat16")
    if mode == "truncate":
        build = build or backend_prefix_build(checkpoint, settings, progress=progress)
        result = bisect_truncate(checkpoint.spec, ref32, ref16, build, settings=settings, progress=progress)
        if fp32_stage:
            from harness.parity.check import structural_stage

            result.fp32_stage = fp32_summary(structural_stage(checkpoint, StageReferences(ref32, ref16), settings,
                                                              progress))
        return result
    from harness.reference.golden import same_weights

    engine = build_port(checkpoint, settings)
    layers = cpu_layers(checkpoint, engine)
    run = {"progress": progress, "fp32_engine": "auto" if fp32_stage else None, "strict_precision": strict_precision,
           "force_path": same_weights(golden, checkpoint) is not False}  # observe.follow_port_path
    return bisect_capture(checkpoint, engine, StageReferences(ref32, ref16), layers, run)


def bisect_golden(checkpoint, golden_path, settings: RunSettings = RunSettings(), mode: str | None = None,
                  **options) -> tuple[BisectResult, dict]:
    """What `gemma-parity bisect` does: read the golden for the checkpoint's spec (or take the
    Golden already read), bisect (options: run_bisect's; the fp32 stage runs unless
    fp32_stage=False), and return the result with its JSON payload (which says whether the golden
    came from these weights)."""
    from harness.reference.golden import Golden, read_golden, same_weights

    golden = golden_path if isinstance(golden_path, Golden) else read_golden(golden_path,
                                                                             expected_spec=checkpoint.spec)
    same = bool(same_weights(golden, checkpoint))
    options.setdefault("fp32_stage", True)
    result = run_bisect(checkpoint, golden, settings, mode, **options)
    payload = result.to_json()
    payload["golden"] = str(golden.path)
    payload["golden_from_same_weights"] = same
    return result, payload
