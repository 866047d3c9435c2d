"""Observing a run: the port and the references, and per capture point the device, reference
and noise-envelope values, with the token runs (free-running and teacher-forced).

`check`, `bisect` and the local per-layer verdicts judge what this module observed; none of them
runs the port or the reference another way. Engines are built here only (`build_port`,
`build_fp32_port`, `layer_backend`), so run settings reach the backends through one place.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.errors import PromptError
from harness.local import intra_op_threads_for
from harness.points import KV_PARTS, Point, kv_points, layer_points
from harness.progress import status
from harness.reference import ReferenceResult
from harness.settings import RunSettings


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
    from harness.golden import Golden, read_golden
    from harness.prompts import load_prompts, validate_prompt_ids

    if isinstance(golden, Golden):
        return golden
    if golden:
        return read_golden(golden, expected_spec=checkpoint.spec)
    loaded = prompts if isinstance(prompts, list) else load_prompts(prompts, checkpoint_dir)
    validate_prompt_ids(checkpoint.spec, loaded, None if isinstance(prompts, list) else prompts)
    return loaded


def load_references(source, checkpoint, new_tokens: int, progress: bool = False):
    """(fp32, bf16) reference results: from a golden, or computed now (once) for the prompts."""
    from harness.golden import Golden
    from harness.reference import run_reference

    if isinstance(source, Golden):
        return source.results("float32"), source.results("bfloat16")
    with intra_op_threads_for(checkpoint.spec):
        refs = run_reference(checkpoint.path, source, new_tokens, progress=progress)
    return refs["float32"], refs["bfloat16"]


def check_inputs_fit(buckets, kv_len: int, prompts: list[list[int]], new_tokens: int) -> None:
    """Bad input is told apart from a port failure before the port runs: every prompt, with its new
    tokens, fits the KV length (a prompt longer than the largest bucket is prefilled in chunks)."""
    for k, prompt in enumerate(prompts):
        n = len(prompt)
        if n + new_tokens > kv_len + 1:
            raise PromptError(f"prompt {k}: {n} tokens + {new_tokens} new tokens exceed the KV length "
                              f"{kv_len}; pass a larger --kv-len or fewer --new-tokens")


# ---- running the port ---------------------------------------------------------------------------

class PortFailure(Exception):
    """An exception raised inside the port while it was observed: a parity failure, not bad input."""

    def __init__(self, phase: str, exc: BaseException):
        super().__init__(f"{phase}: {type(exc).__name__}: {exc}")
        self.phase, self.exc = phase, exc

    def describe(self) -> dict:
        """Where it was raised (the innermost frame) and, when that is outside the package, the
        innermost frame of the port that called it."""
        frames = traceback.extract_tb(self.exc.__traceback__)
        package = Path(__file__).parent
        inside = [f for f in frames if f.filename.startswith(str(package))]
        where = _frame(frames[-1], package.parent) if frames else "unknown"
        if inside and inside[-1] is not frames[-1]:
            where += f" (called from {_frame(inside[-1], package.parent)})"
        return {"where": where, "phase": self.phase, "type": type(self.exc).__name__, "message": str(self.exc)}


def _frame(frame, root: Path) -> str:
    path = Path(frame.filename)
    shown = path.relative_to(root) if path.is_relative_to(root) else path
    return f"{shown}:{frame.lineno} in {frame.name}"


def port_call(phase: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # anything the port raises is the port's failure
        raise PortFailure(phase, exc) from exc


@dataclass
class PortPrompt:
    """One prompt through the port: teacher-forced run with captures and cache reads, free run."""

    forced: object  # DecodeResult
    free: object  # DecodeResult
    kv: list  # [(written, [(k, v) per layer])]
    prefill_probs: torch.Tensor
    step_probs: torch.Tensor


def run_port_prompt(engine, r32: ReferenceResult, phase: str) -> PortPrompt:
    n_new = len(r32.generated)
    read = engine.read_cache if engine.backend.reads_cache else None
    snaps = []
    observe = (lambda written: snaps.append((written, read(written)))) if read else None
    forced = port_call(f"{phase}: prefill and teacher-forced decode", engine.generate, r32.prompt, n_new,
                       capture=True, forced=r32.generated or None, observe=observe)
    free = port_call(f"{phase}: free greedy decode", engine.generate, r32.prompt, n_new) if n_new else forced
    probs = port_call(f"{phase}: host probabilities", engine.probabilities, forced.prefill.logits)
    steps = port_call(f"{phase}: host probabilities", engine.probabilities, forced.step_logits)
    return PortPrompt(forced, free, snaps, probs, steps)


def run_port_batch(engine, ref32: list[ReferenceResult], phase: str) -> list[PortPrompt]:
    """Every prompt as a sequence of a batch (harness.batching: settings.batch KV slots, ragged
    prefill, continuous batching): the same runs as run_port_prompt, each sequence read from its
    own slot, so each is judged against the reference of its prompt alone."""
    from harness.batching import BatchEngine

    be = port_call(f"{phase}: batch engine", BatchEngine, engine)
    prompts, wants = [r.prompt for r in ref32], [len(r.generated) for r in ref32]
    snaps: list[list] = [[] for _ in ref32]
    observe = ((lambda k, slot, written: snaps[k].append((written, be.read_cache(slot, written))))
               if engine.backend.reads_cache else None)
    forced = port_call(f"{phase}: batched prefill and teacher-forced decode", be.generate, prompts, wants,
                       capture=True, forced=[r.generated for r in ref32], observe=observe)
    free = port_call(f"{phase}: batched free greedy decode", be.generate, prompts, wants) if any(wants) else forced
    return [PortPrompt(f, g, kv, port_call(f"{phase}: host probabilities", engine.probabilities, f.prefill.logits),
                       port_call(f"{phase}: host probabilities", engine.probabilities, f.step_logits))
            for f, g, kv in zip(forced, free, snaps)]


# ---- the observation of one stage ----------------------------------------------------------------

@dataclass
class StageObservation:
    """Per capture point the device, fp32 reference and bf16 reference (envelope) values stacked
    over prompts, a label per row, and the token runs."""

    stage: str
    runs: list[PortPrompt]
    ref32: list[ReferenceResult]
    ref16: list[ReferenceResult]
    dev: dict[str, torch.Tensor] = field(default_factory=dict)
    ref: dict[str, torch.Tensor] = field(default_factory=dict)
    env: dict[str, torch.Tensor] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)
    reads_cache: bool = True
    seconds: float = 0.0

    def add(self, name: str, values: tuple, labels: list[str]) -> None:
        """values: (device, fp32 reference, bf16 reference) rows of one prompt."""
        for store, t in zip((self.dev, self.ref, self.env), values):
            store.setdefault(name, []).append(t.float())
        if name in ("embeddings", "decode.embeddings", "decode_logits", "decode.kv.0.k"):
            self.labels.setdefault(Point.parse(name).rows, []).extend(labels)
        if Point.parse(name).kind == "kv":  # a ring layer holds fewer rows than its row group
            self.labels.setdefault(name, []).extend(labels)

    def stack(self) -> None:
        for store in (self.dev, self.ref, self.env):
            for name, parts in store.items():
                store[name] = torch.cat(parts)

    def label(self, name: str, row: int) -> str:
        labels = self.labels.get(name) or self.labels.get(Point.parse(name).rows, [])
        return labels[row] if 0 <= row < len(labels) else f"row {row}"


def observe_stage(stage: str, engine, spec, refs: tuple, progress: bool = False) -> StageObservation:
    """Every prompt through the engine (prefill with captures and cache reads, teacher-forced
    decode with captures, free greedy decode, host probabilities) next to refs = (fp32, bf16)."""
    ref32, _ = refs
    start = time.perf_counter()
    runs = []
    say = status(f"port {stage}", progress, total=len(ref32))
    with intra_op_threads_for(spec):
        if engine.settings.batch > 1:  # the prompts as the sequences of a batch
            say(f"{len(ref32)} prompts as a batch of {engine.settings.batch} sequences")
            runs = run_port_batch(engine, ref32, f"{stage} stage, batch of {engine.settings.batch}")
        for k, r32 in enumerate(ref32 if engine.settings.batch == 1 else ()):
            say(f"prompt {k}/{len(ref32) - 1}: prefill {len(r32.prompt)} tokens, decode {len(r32.generated)}")
            runs.append(run_port_prompt(engine, r32, f"{stage} stage, prompt {k} ({len(r32.prompt)} tokens)"))
    say.close()
    obs = assemble_observation(stage, runs, spec, refs, engine.backend.reads_cache)
    obs.seconds = time.perf_counter() - start
    return obs


def assemble_observation(stage: str, runs: list[PortPrompt], spec, refs: tuple,
                         reads_cache: bool = True) -> StageObservation:
    """The port's runs beside refs = (fp32, bf16), point by point. Also how the same runs are set
    beside other references (the MoE routing policy's re-routed ones, harness.routing)."""
    ref32, ref16 = refs
    obs = StageObservation(stage, runs, ref32, ref16, reads_cache=reads_cache)
    for k, (run, r32, r16) in enumerate(zip(runs, ref32, ref16)):
        _prefill_points(obs, spec, k, run, (r32, r16))
        _decode_points(obs, spec, k, run, (r32, r16))
    obs.stack()
    return obs


def own_caches(cache: list) -> list:
    """(layer, (k, v)) of the layers that hold a cache (None: a KV-shared layer)."""
    return [(i, c) for i, c in enumerate(cache) if c is not None]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A cache read [kv_heads, positions, head_dim] as the reference stores it: [positions, kv_heads * head_dim]."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _prefill_points(obs: StageObservation, spec, k: int, run: PortPrompt, refs: tuple) -> None:
    r32, r16 = refs
    pre = run.forced.prefill
    dev = dict(pre.captures, logits=pre.logits)
    labels = [f"prompt {k} position {p}" for p in range(pre.logits.shape[0])]
    names = ["embeddings"] + [n for layer in spec.layers for n in layer_points(layer.index, spec=spec)] + ["final_norm", "logits"]
    for name in names:
        obs.add(name, (dev[name], r32.captures[name], r16.captures[name]), labels)
    if run.kv and all(kv_points(i)[0] in r32.captures for i, c in enumerate(run.kv[0][1]) if c is not None):
        written, cache = run.kv[0]
        for i, pair in own_caches(cache):  # a KV-shared layer (model_blocks) holds none
            held = written - pair[0].shape[1]  # a ring layer holds only its last window positions
            for name, t in zip(kv_points(i), pair):
                obs.add(name, (_rows(t), r32.captures[name][held:written], r16.captures[name][held:written]),
                        labels[held:])


def _decode_points(obs: StageObservation, spec, k: int, run: PortPrompt, refs: tuple) -> None:
    r32, r16 = refs
    n, forced = len(r32.prompt), run.forced
    steps = forced.step_logits.shape[0]
    step_labels = [f"prompt {k} decode step {s} (position {n + s - 1})" for s in range(steps)]
    if steps:
        obs.add("decode_logits", (forced.step_logits, r32.step_logits, r16.step_logits), step_labels)
    if steps > 1 and "decode.final_norm" in r32.captures:
        for name, dev in forced.step_captures.items():
            full = f"decode.{name}"
            obs.add(full, (dev, r32.captures[full], r16.captures[full]), step_labels[1:])
    if len(run.kv) > 1 and "kv.0.k" in r32.captures:
        for s, (written, cache) in enumerate(run.kv[1:], 1):
            # after each step every slot decode has written so far, and after the last step every
            # written slot (a step that overwrote a prefill slot shows there)
            start = 0 if s == len(run.kv) - 1 else n
            labels = [f"prompt {k} position {p} after decode step {s}" for p in range(start, written)]
            for i, pair in own_caches(cache):  # a KV-shared layer (model_blocks) holds none
                first = written - pair[0].shape[1]  # a ring layer holds only its last window positions
                held = max(start, first)
                for side, t in zip(KV_PARTS, pair):
                    ref_name = Point("kv", i, side).name
                    obs.add(Point("kv", i, side, decode=True).name,
                            (_rows(t)[held - first:], r32.captures[ref_name][held:written],
                             r16.captures[ref_name][held:written]), labels[held - start:])
