"""Observing a run: the port and the references, and per capture point the device, reference
and noise-envelope values, with the token runs (free-running and teacher-forced).

The whole observation is made here: `observe_stage` runs the port, sets it beside the references,
and computes the references again along the port's path where the judge's rules say bf16 decides a
step legitimately otherwise (harness/parity/forced_path.py: MoE routing, PLE pins). `check`,
`bisect` and the local per-layer verdicts judge what this module observed (as
harness/parity/observation.py's data); none of them runs the port or the reference another way. The
parity stages' engines are built here (`build_port`, `build_fp32_port`, `layer_backend`); the
served, speculative, truncate, quality and perf runs build theirs through
harness.backends.build_engine, so run settings reach the backends through one place; the prompt-fit
rule (harness.inputs.prompts.validate_prompt_fit) is applied here for the library as the commands
apply it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from harness.base.progress import status
from harness.base.settings import RunSettings
from harness.inputs.prompts import validate_prompt_fit
from harness.judge.compare import FORCING_PASSES
from harness.judge.verdicts import NearTieCalibration
from harness.parity.forced_path import add_pins, follow_routing, routes_differ, seed_pins
from harness.parity.local import intra_op_threads_for
from harness.parity.observation import PortPrompt, StageObservation, StageReferences, assemble_observation
from harness.parity.own_path import OwnPath, router_alone
from harness.parity.port_failure import PortFailure, port_call  # noqa: F401  (re-exported: the stages' phases)
from harness.reference.run import ReferenceResult, rerun_reference


@dataclass(frozen=True)
class StageContext:
    """The context of a stage: its name (fp32 | bf16), what its result is labelled with (backend,
    TP degree, dtype name), the check's near-tie calibration, the fp32 stage's structural flips
    ((prompt, "prefill"|"decode") -> rows), whether it shows progress, whether the references
    may be computed again along the port's path (not against a golden of other weights), and the
    pins they start from (per prompt layer -> position -> value: the batch stage's are the bf16 stage's)."""

    stage: str
    backend: str
    tp: int
    dtype: str
    calibration: NearTieCalibration | None = None
    structural: dict = field(default_factory=dict)
    progress: bool = False
    force_path: bool = True
    pins: list | None = None


# ---- engines: the one place run settings reach a backend ---------------------------------------

def build_port(checkpoint, settings: RunSettings):
    """The parity build of the port (captures as extra outputs), run as `settings` say."""
    from harness.backends import build_engine

    return build_engine(checkpoint, settings, capture=True)


def fp32_settings(settings: RunSettings) -> RunSettings:
    """Where the fp32 stage runs: on the backend itself when it runs on the host (cpu, xla), else
    on cpu (without the device's options), in fp32, with the same TP degree, buckets and KV length."""
    if settings.backend in ("cpu", "xla"):
        return settings.but(dtype="float32")
    return settings.but(backend="cpu", dtype="float32", backend_options={})


def build_fp32_port(checkpoint, settings: RunSettings):
    """The port in fp32 for the structural stage, on the host backend."""
    return port_call("fp32 stage: building the fp32 port", lambda: build_port(checkpoint, fp32_settings(settings)))


def layer_backend(checkpoint, engine):
    """A backend whose rank modules run one layer alone: the engine's own when its ranks live on
    this host, else a CPU backend of the engine's settings."""
    if engine.backend.host_ranks:
        return engine.backend
    from harness.backends import make_backend

    return make_backend(checkpoint, engine.settings.but(backend="cpu", backend_options={}))


# ---- the reference ------------------------------------------------------------------------------

def load_reference_source(checkpoint, checkpoint_dir, golden=None, prompts=None):
    """The golden (read and verified against the checkpoint's spec) or the validated prompts:
    every input checked before any expensive work starts. `golden` may be a Golden already read
    and `prompts` token-id lists already loaded (the command's validation pass did it)."""
    from harness.inputs.prompts import load_prompts, validate_prompt_ids
    from harness.reference.golden import Golden, read_golden

    if isinstance(golden, Golden):
        return golden
    if golden:
        return read_golden(golden, expected_spec=checkpoint.spec)
    loaded = prompts if isinstance(prompts, list) else load_prompts(prompts, checkpoint_dir)
    validate_prompt_ids(checkpoint.spec, loaded, None if isinstance(prompts, list) else prompts)
    return loaded


def load_references(source, checkpoint, new_tokens: int, progress: bool = False):
    """(fp32, bf16) reference results: from a golden, or computed now (once) for the prompts."""
    from harness.reference.golden import Golden
    from harness.reference.run import run_reference

    if isinstance(source, Golden):
        return source.results("float32"), source.results("bfloat16")
    with intra_op_threads_for(checkpoint.spec):
        refs = run_reference(checkpoint.path, source, new_tokens, progress=progress)
    return refs["float32"], refs["bfloat16"]


def check_fit(spec, settings: RunSettings, references: list[ReferenceResult] | list[list[int]],
              new_tokens: int | None = None) -> None:
    """The prompt-fit rule (harness.inputs.prompts.validate_prompt_fit, the one the commands apply) for the
    library: bad input is told apart from a port failure before the port runs. `references`: the
    reference results (their prompts and tokens) or prompts with `new_tokens`."""
    prompts = [getattr(r, "prompt", r) for r in references]
    if new_tokens is None:
        new_tokens = max((len(r.generated) for r in references), default=0)
    if prompts:
        validate_prompt_fit(prompts, new_tokens, "the checked prompts", buckets=settings.buckets,
                            kv_len=settings.kv_len, max_positions=spec.max_positions)


# ---- running the port ---------------------------------------------------------------------------

def run_port_prompt(engine, r32: ReferenceResult, phase: str) -> PortPrompt:
    from harness.port.decode import forced as forcing, generate

    n_new = len(r32.generated)
    read = engine.read_cache if engine.backend.reads_cache else None
    snaps = []
    observe = (lambda _prompt, _slot, written: snaps.append((written, read(written)))) if read else None
    forced = port_call(f"{phase}: prefill and teacher-forced decode", lambda: generate(
        engine, [r32.prompt], n_new, forcing([r32.generated]), capture=True, observe=observe)[0])
    free = port_call(f"{phase}: free greedy decode", lambda: generate(engine, [r32.prompt], n_new)[0]) if n_new else forced
    probs = port_call(f"{phase}: host probabilities", engine.probabilities, forced.prefill.logits)
    steps = port_call(f"{phase}: host probabilities", engine.probabilities, forced.step_logits)
    return PortPrompt(forced, free, snaps, probs, steps)


# ---- the observation of one stage ----------------------------------------------------------------

def observe_stage(engine, checkpoint, refs: StageReferences, context: StageContext,
                  run_prompts=None) -> StageObservation:
    """The whole observation of one stage: every prompt through the engine (prefill with captures
    and cache reads, teacher-forced decode with captures, free greedy decode, host probabilities)
    next to the references, which then follow the port's path where the judge's rules say so
    (follow_port_path). `run_prompts(engine, ref32, context)` runs them (default run_port_prompts,
    one at a time; harness/parity/batched.py's run_port_batch, as a batch). The prompt-fit rule is
    applied first: a prompt that does not fit is bad input (harness.base.errors.PromptError)."""
    spec = checkpoint.spec
    check_fit(spec, engine.settings, refs.fp32)
    start = time.perf_counter()
    with intra_op_threads_for(spec):
        runs = (run_prompts or run_port_prompts)(engine, refs.fp32, context)
    seconds = time.perf_counter() - start
    obs = assemble_observation(context.stage, runs, spec, refs, engine.backend.reads_cache)
    obs.followed = context.force_path
    if context.stage == "fp32":  # nothing forced: the envelope is float64 along the fp32 reference's path
        obs.env = fp32_envelope(obs, checkpoint, context.progress)
    elif context.force_path:
        obs = follow_port_path(obs, checkpoint, context.pins)
    if context.stage == "bf16":
        obs.own_path = OwnPath(checkpoint, obs.runs)
        obs.alone_routers = router_alone(obs.own_path.reference, obs.dev, spec) if spec.moe is not None else {}
    obs.seconds = seconds
    return obs


def run_port_prompts(engine, ref32: list[ReferenceResult], context: StageContext) -> list[PortPrompt]:
    """Every prompt alone through the engine."""
    say = status(f"port {context.stage}", context.progress, total=len(ref32))
    runs = []
    for k, r32 in enumerate(ref32):
        say(f"prompt {k}/{len(ref32) - 1}: prefill {len(r32.prompt)} tokens, decode {len(r32.generated)}")
        runs.append(run_port_prompt(engine, r32, f"{context.stage} stage, prompt {k} ({len(r32.prompt)} tokens)"))
    say.close()
    return runs


def fp32_envelope(obs: StageObservation, checkpoint, progress: bool = False) -> dict:
    """The fp32 stage's envelope values: transformers in float64 along the fp32 reference's path
    (harness/reference/float64.py), stacked as the observation's rows (the stage's `env`)."""
    from harness.reference.float64 import float64_references

    ref64 = float64_references(checkpoint, obs.ref32, progress)
    return assemble_observation(obs.stage, obs.runs, checkpoint.spec, StageReferences(obs.ref32, ref64),
                                obs.reads_cache).env


def follow_port_path(obs: StageObservation, checkpoint, pins: list | None = None) -> StageObservation:
    """The references computed again along the port's path where bf16 legitimately decides otherwise
    (harness/parity/forced_path.py's rules): MoE, the port's experts; PLE, the port's gated per-layer input
    at rows without a direction at bf16 precision (at most FORCING_PASSES passes), starting from `pins`
    (the references already hold them: run again only where the port's value differs). Same port runs."""
    spec = checkpoint.spec
    forcing = follow_routing(obs.runs, spec, obs.stage)
    repinned = seed_pins(forcing, pins, obs.runs)
    fed, rerun, pinned = [r.generated for r in obs.ref32], [], []
    for attempt in range(FORCING_PASSES):
        added = add_pins(obs, checkpoint, forcing) + (repinned if attempt == 0 else [])
        pinned += added
        refs = {"float32": obs.ref32, "bfloat16": obs.ref16}
        stale = [dtype for dtype, runs in refs.items()
                 if added or (attempt == 0 and routes_differ(forcing, runs, spec))]
        if not stale:
            break
        for dtype in stale:
            refs[dtype] = rerun_reference(checkpoint.path, dtype, fed, (refs[dtype], forcing))
        obs = assemble_observation(obs.stage, obs.runs, spec, StageReferences(refs["float32"], refs["bfloat16"]),
                                   obs.reads_cache)
        rerun += [d for d in stale if d not in rerun]
    obs.rerouted, obs.pinned, obs.forcing = rerun, pinned, forcing
    return obs
