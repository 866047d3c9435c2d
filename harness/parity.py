"""One parity run: the port on a backend against the reference (fresh or from a golden), judged
by compare.py's policy in two stages. What `gemma-parity check` and the parity suites execute.

- **fp32 structural stage**: the port in fp32 (on CPU, or on the backend itself when it is cpu/xla)
  must equal the fp32 reference to fp32 precision at every capture point and token for token. A
  structural bug (a wrong activation, rope angles in low precision, a decode-only mask) cannot
  hide inside bf16 noise there.
- **bf16 envelope stage**: the port in its own dtype, judged by the bf16 noise envelope, with the
  near-tie band calibrated from the references' own margins; a flip the fp32 stage also shows is
  never a near tie.

Capture points of both stages: prefill (embeddings, every layer's attention residual, MLP residual
and output, final norm, raw logits); the KV cache after prefill and after every decode step (per
layer, keys and values at the written positions); every teacher-forced decode step (the same
per-layer points, and its raw logits); and the host's served probabilities (softcap + softmax)
against the reference's own capped distribution.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from harness.compare import (FP32_FACTOR, LayerResult, LogitsResult, NearTieCalibration, PointResult,
                             ProbabilityResult, TokenVerdict, calibrate_near_ties, classify_mismatch, compare_logits,
                             compare_point, compare_point_fp32, compare_probabilities, layer_points, saturation_tie)
from harness.errors import PromptError
from harness.local import PortRun, local_verdicts
from harness.progress import status
from harness.reference import ReferenceResult
from harness.spec_family import layer_points_for, part_of_point

STAGES = ("fp32", "bf16")
# fp32 stage: a token flip is a tie only when the reference's margin is within this fraction of the
# largest |logit| (fp32 rounding of the logits is ~1e-6 of it); anything wider is structural.
FP32_TIE_FRACTION = 1e-4


@dataclass
class PromptOutcome:
    prompt: list[int]
    reference_tokens: list[int]
    device_tokens: list[int]
    prefill: LogitsResult
    decode: LogitsResult  # teacher-forced on the reference tokens
    # Where the free-running sequence first departs from the reference, with its class:
    # near_tie / saturation_tie (accounted for), divergence, or unexplained (the free run's token
    # is not what the same prefix gives teacher-forced): the last two fail the check.
    departure: TokenVerdict | None = None

    @property
    def seq_match(self) -> bool:
        return self.reference_tokens == self.device_tokens

    @property
    def first_mismatch(self) -> int | None:
        return next((i for i, (a, b) in enumerate(zip(self.reference_tokens, self.device_tokens)) if a != b), None)

    @property
    def accounted(self) -> bool:
        """SEQ_MATCH, or the departure is classified as a tie."""
        return self.seq_match or (self.departure is not None
                                  and self.departure.kind in ("near_tie", "saturation_tie"))

    def to_json(self) -> dict:
        return {"prompt_length": len(self.prompt), "reference_tokens": self.reference_tokens,
                "device_tokens": self.device_tokens, "seq_match": self.seq_match,
                "first_mismatch": self.first_mismatch, "prefill_logits": self.prefill.to_json(),
                "decode_logits_teacher_forced": self.decode.to_json(),
                "departure": asdict(self.departure) if self.departure else None,
                "accounted": self.accounted}


@dataclass
class CheckResult:
    backend: str
    tp: int
    dtype: str
    embeddings: PointResult | None = None
    layers: list[LayerResult] = field(default_factory=list)
    final_norm: PointResult | None = None
    prompts: list[PromptOutcome] = field(default_factory=list)
    # Raw logits at every prompt position and at every teacher-forced decode step.
    logits: PointResult | None = None
    decode_logits: PointResult | None = None
    # The host embedding lookup is transformers' lookup and multiply: in the port's dtype it must be
    # bit-exact with the reference of that dtype.
    embeddings_exact: bool = True
    # Local verdicts (CPU backend, bf16 stage): each layer alone on the reference's input to it.
    local: list[dict] | None = None
    notes: list[str] = field(default_factory=list)
    # The port's prefill captures stacked over prompts (name -> [rows, ...]), for the local verdicts.
    device_captures: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    stage: str = "bf16"  # "fp32" (structural) or "bf16" (envelope)
    kv: list[PointResult] = field(default_factory=list)  # kv.{i}.k/v after prefill, decode.kv.* after steps
    decode_layers: list[LayerResult] = field(default_factory=list)  # teacher-forced decode, per layer
    decode_points: list[PointResult] = field(default_factory=list)  # decode.embeddings, decode.final_norm
    probabilities: list[ProbabilityResult] = field(default_factory=list)
    calibration: NearTieCalibration | None = None
    port_error: dict | None = None  # an exception raised inside the port: a parity failure
    fp32: "CheckResult | None" = None  # the structural stage, on the bf16 stage's result
    row_labels: dict[str, list[str]] = field(default_factory=dict, repr=False)

    @property
    def seq_match(self) -> bool:
        return all(p.seq_match for p in self.prompts)

    def _first_layer_failure(self) -> tuple[int, str] | None:
        """(layer, component) of the first failing point in run order that belongs to a layer:
        its KV cache or attention residual (attention), its MLP residual or output (mlp)."""
        for p in self.all_points():
            parts = p.name.removeprefix("decode.").split(".")
            if not p.passed and parts[0] in ("layers", "kv"):
                return int(parts[1]), part_of_point(p.name)
        return None

    def _divergent(self) -> tuple[int, str] | None:
        """The local verdict's first failing layer where it exists, else this stage's first failing
        layer point, else the fp32 stage's."""
        local = next((v for v in self.local or [] if not v["pass"]), None)
        if local is not None:
            return local["index"], local["component"]
        own = self._first_layer_failure()
        if own is None and self.fp32 is not None:
            return self.fp32._divergent()
        return own

    @property
    def first_divergent_layer(self) -> int | None:
        found = self._divergent()
        return found[0] if found else None

    @property
    def first_divergent_component(self) -> str | None:
        found = self._divergent()
        return found[1] if found else None

    @property
    def near_ties(self) -> int:
        return sum(p.prefill.near_ties + p.decode.near_ties for p in self.prompts)

    @property
    def divergences(self) -> int:
        return sum(p.prefill.divergences + p.decode.divergences for p in self.prompts)

    def all_points(self) -> list[PointResult]:
        """Every capture point of this stage, in run order: per layer its KV cache (written inside
        its attention) before its residual points; prefill, then the decode steps."""
        kv: dict[str, list[PointResult]] = {}
        for p in self.kv:
            kv.setdefault(p.name.rsplit(".", 1)[0], []).append(p)  # "kv.3" / "decode.kv.3"

        def per_layer(layers: list[LayerResult], prefix: str) -> list[PointResult]:
            return [p for layer in layers for p in kv.get(f"{prefix}kv.{layer.index}", []) + layer.points]

        prefill = ([self.embeddings] if self.embeddings else []) + per_layer(self.layers, "")
        prefill += [p for p in (self.final_norm, self.logits) if p is not None]
        decode = self.decode_points[:1] + per_layer(self.decode_layers or _kv_only(self.kv), "decode.")
        decode += self.decode_points[1:] + ([self.decode_logits] if self.decode_logits else [])
        return prefill + decode

    def failures(self) -> list[dict]:
        """What fails in this stage, in run order: each with the stage, the point and where."""
        if self.port_error:
            return [dict(self.port_error, stage=self.stage, point="exception inside the port")]
        out = []
        if not self.embeddings_exact:
            out.append({"stage": self.stage, "point": "embeddings", "where": "the host lookup",
                        "detail": f"not bit-exact with the {self.dtype} reference's lookup"})
        for p in self.all_points() + self.probabilities:
            if not p.passed:
                factor = p.required_factor if isinstance(p, PointResult) else p.ratio
                out.append({"stage": self.stage, "point": p.name, "ratio": _finite(factor),
                            "where": self._row_label(p.name, p.worst_position)})
        out += [{"stage": self.stage, "point": f"layer {v['index']} alone ({v['component']})",
                 "ratio": v["ratio"], "where": "local verdict"} for v in self.local or [] if not v["pass"]]
        for k, pr in enumerate(self.prompts):
            for part, lg in (("prefill", pr.prefill), ("decode", pr.decode)):
                out += [{"stage": self.stage, "point": f"{part} token", "where": f"prompt {k} row {m.position}",
                         "detail": m.evidence} for m in lg.mismatches if m.kind == "divergence"]
            if not pr.accounted and not any(m.kind == "divergence" for m in pr.decode.mismatches):
                d = pr.departure
                out.append({"stage": self.stage, "point": "sequence", "where": f"prompt {k} step {pr.first_mismatch}",
                            "detail": d.evidence if d else "unclassified sequence mismatch"})
        return out

    def _row_label(self, name: str, row: int) -> str:
        key = _label_group(name)
        labels = self.row_labels.get(key, [])
        return labels[row] if 0 <= row < len(labels) else f"row {row}"

    @property
    def stage_passed(self) -> bool:
        return not self.failures()

    @property
    def passed(self) -> bool:
        """Every capture point of both stages within its judge, every token mismatch accounted for
        (a near tie or a saturation tie), and no exception inside the port."""
        return self.stage_passed and (self.fp32 is None or self.fp32.passed)

    @property
    def failed_stages(self) -> list[str]:
        stages = [s for s in (self.fp32,) if s is not None and not s.stage_passed]
        return [s.stage for s in stages] + ([self.stage] if not self.stage_passed else [])

    def _layer_json(self, layer: LayerResult) -> dict:
        out = layer.to_json()
        local = next((v for v in self.local or [] if v["index"] == layer.index), None)
        if local is not None:
            out["local_ratio"], out["local_pass"] = local["ratio"], local["pass"]
            out["pass"] = out["pass"] and local["pass"]
            out["component"] = out["component"] or local["component"]
        return out

    def stage_json(self) -> dict:
        judge = (f"fp32 precision: error <= {FP32_FACTOR:g}x the bf16 envelope scaled to fp32 (x2^-16) at "
                 "every point and position, tokens exact" if self.stage == "fp32" else "bf16 envelope")
        return {"stage": self.stage, "dtype": self.dtype, "passed": self.stage_passed, "judge": judge,
                "failures": self.failures(), "points": len(self.all_points()) + len(self.probabilities),
                "port_error": self.port_error, "notes": self.notes,
                "kv_points": [asdict(p) for p in self.kv],
                "decode_layers": [layer.to_json() for layer in self.decode_layers],
                "decode_points": [asdict(p) for p in self.decode_points],
                "probabilities": [asdict(p) for p in self.probabilities],
                "near_tie_calibration": asdict(self.calibration) if self.calibration else None,
                "seq_match": self.seq_match, "prompts": [p.to_json() for p in self.prompts]}

    def to_json(self) -> dict:
        def d(p):
            return p.__dict__ if p is not None else None

        stages = {s.stage: s.stage_json() for s in (self.fp32, self) if s is not None}
        failures = [f for s in (self.fp32, self) if s is not None for f in s.failures()]
        out = {"passed": self.passed, "seq_match": self.seq_match, "backend": self.backend,
               "tp": self.tp, "dtype": self.dtype, "first_divergent_layer": self.first_divergent_layer,
               "first_divergent_component": self.first_divergent_component, "local_layers": self.local,
               "near_tie_flips": self.near_ties, "real_divergences": self.divergences,
               "embeddings": d(self.embeddings), "embeddings_exact": self.embeddings_exact,
               "final_norm": d(self.final_norm), "logits": d(self.logits), "decode_logits": d(self.decode_logits),
               "layers": [self._layer_json(layer) for layer in self.layers],
               "prompts": [p.to_json() for p in self.prompts],
               "notes": self.notes + (self.fp32.notes if self.fp32 else []), "stages": stages, "failed_stages": self.failed_stages,
               "failed_stage": self.failed_stages[0] if self.failed_stages else None,
               "first_failure": failures[0] if failures else None,
               "near_tie_calibration": asdict(self.calibration) if self.calibration else None,
               "port_error": self.port_error or (self.fp32.port_error if self.fp32 else None)}
        return out


def _kv_only(kv: list[PointResult]) -> list[LayerResult]:
    """Decode KV points with no decode layer points beside them (a golden without decode captures)."""
    layers = sorted({int(p.name.split(".")[2]) for p in kv if p.name.startswith("decode.kv.")})
    return [LayerResult(i, "", []) for i in layers]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _label_group(name: str) -> str:
    """Capture points that share a row layout (and so row labels)."""
    if name.startswith("decode.kv."):
        return "decode_kv"
    if name in ("decode_logits", "decode_probabilities"):
        return "steps"
    if name.startswith("decode."):
        return "decode"
    return "prefill"


# ---- running the port -------------------------------------------------------------------------

class PortFailure(Exception):
    """An exception raised inside the port while `check` ran it: a parity failure, not bad input."""

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


def _port_call(phase: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # anything the port raises is the port's failure
        raise PortFailure(phase, exc) from exc


@dataclass
class _PortPrompt:
    """One prompt through the port: teacher-forced run with captures and cache reads, free run."""

    forced: object  # DecodeResult
    free: object  # DecodeResult
    kv: list  # [(written, [(k, v) per layer])]
    prefill_probs: torch.Tensor
    step_probs: torch.Tensor


def run_port_prompt(engine, r32: ReferenceResult, phase: str) -> _PortPrompt:
    n_new = len(r32.generated)
    read = getattr(engine.backend, "read_cache", None)
    snaps = []
    observe = (lambda written: snaps.append((written, read(written)))) if read else None
    forced = _port_call(f"{phase}: prefill and teacher-forced decode", engine.generate, r32.prompt, n_new,
                        capture=True, forced=r32.generated or None, observe=observe)
    free = _port_call(f"{phase}: free greedy decode", engine.generate, r32.prompt, n_new) if n_new else forced
    probs = _port_call(f"{phase}: host probabilities", engine.probabilities, forced.prefill.logits)
    steps = _port_call(f"{phase}: host probabilities", engine.probabilities, forced.step_logits)
    return _PortPrompt(forced, free, snaps, probs, steps)


# ---- gathering the points of one stage ----------------------------------------------------------

def _rows(t: torch.Tensor) -> torch.Tensor:
    """A cache read [kv_heads, positions, head_dim] as the reference stores it: [positions, kv_heads * head_dim]."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


class _Points:
    """Device, reference and envelope tensors per capture point, stacked over prompts, with a label
    per row (prompt, position, decode step) so a failure is named where it happened."""

    def __init__(self):
        self.dev, self.ref, self.env, self.labels = {}, {}, {}, {}

    def add(self, name: str, dev, ref, env, labels: list[str]):
        for store, t in ((self.dev, dev), (self.ref, ref), (self.env, env)):
            store.setdefault(name, []).append(t.float())
        group = _label_group(name)
        if name in ("embeddings", "decode.embeddings", "decode_logits", "decode.kv.0.k"):
            self.labels.setdefault(group, []).extend(labels)

    def stacked(self):
        cat = {n: torch.cat(v) for n, v in self.dev.items()}
        return cat, {n: torch.cat(v) for n, v in self.ref.items()}, {n: torch.cat(v) for n, v in self.env.items()}


def _prefill_points(points: _Points, spec, k: int, run: _PortPrompt, r32, r16) -> None:
    pre = run.forced.prefill
    dev = dict(pre.captures, logits=pre.logits)
    n = pre.logits.shape[0]
    labels = [f"prompt {k} position {p}" for p in range(n)]
    names = (["embeddings"] + [n_ for layer in spec.layers for n_ in layer_points_for(spec, layer.index)]
             + ["final_norm", "logits"])
    for name in names:
        points.add(name, dev[name], r32.captures[name], r16.captures[name], labels)
    if run.kv and all(f"kv.{i}.k" in r32.captures for i, c in enumerate(run.kv[0][1]) if c is not None):
        written, cache = run.kv[0]
        for i, (k_, v_) in _own_caches(cache):  # a KV-shared layer has none (its source's is judged)
            for side, t in (("k", k_), ("v", v_)):
                name = f"kv.{i}.{side}"
                points.add(name, _rows(t), r32.captures[name][:written], r16.captures[name][:written], labels)


def _own_caches(cache: list) -> list:
    return [(i, c) for i, c in enumerate(cache) if c is not None]


def _decode_points(points: _Points, spec, k: int, run: _PortPrompt, r32, r16) -> None:
    n, forced = len(r32.prompt), run.forced
    steps = forced.step_logits.shape[0]
    step_labels = [f"prompt {k} decode step {s} (position {n + s - 1})" for s in range(steps)]
    if steps:
        points.add("decode_logits", forced.step_logits, r32.step_logits, r16.step_logits, step_labels)
    if steps > 1 and "decode.final_norm" in r32.captures:
        for name, dev in forced.step_captures.items():
            points.add(f"decode.{name}", dev, r32.captures[f"decode.{name}"], r16.captures[f"decode.{name}"],
                       step_labels[1:])
    if len(run.kv) > 1 and "kv.0.k" in r32.captures:
        for s, (written, cache) in enumerate(run.kv[1:], 1):
            # after each step every slot decode has written so far, and after the last step every
            # written slot (a step that overwrote a prefill slot shows there)
            rows = range(0 if s == len(run.kv) - 1 else n, written)
            labels = [f"prompt {k} position {p} after decode step {s}" for p in rows]
            for i, (k_, v_) in _own_caches(cache):
                for side, t in (("k", k_), ("v", v_)):
                    ref_name = f"kv.{i}.{side}"
                    points.add(f"decode.{ref_name}", _rows(t)[rows.start:], r32.captures[ref_name][rows.start:written],
                               r16.captures[ref_name][rows.start:written], labels)


def _judge(stage: str):
    if stage == "fp32":
        return compare_point_fp32
    return compare_point


def _layers(spec, judge, dev, ref, env, prefix: str = "", routing: bool = True) -> list[LayerResult]:
    out = []
    for layer in spec.layers:
        names = [prefix + n for n in layer_points_for(spec, layer.index, routing)]
        if all(n in dev for n in names):
            out.append(LayerResult(layer.index, layer.type, [judge(n, dev[n], ref[n], env[n]) for n in names]))
    return out


def _probabilities(stage, runs, ref32, ref16) -> list[ProbabilityResult]:
    """The host's served distribution vs the reference's own capped one (transformers' softcap),
    judged by the bf16 reference's (bf16 stage) or fp32 precision (fp32 stage)."""
    def stacked(refs, key):
        return torch.cat([r.captures[key] for r in refs])

    envelope = (lambda key: stacked(ref16, key)) if stage == "bf16" else (lambda key: None)
    out = [compare_probabilities("probabilities", torch.cat([r.prefill_probs for r in runs]),
                                 stacked(ref32, "capped_logits"), envelope("capped_logits"))]
    if all("step_capped_logits" in r.captures for r in ref32) and any(r.generated for r in ref32):
        out.append(compare_probabilities("decode_probabilities", torch.cat([r.step_probs for r in runs]),
                                         stacked(ref32, "step_capped_logits"), envelope("step_capped_logits")))
    return out


# ---- tokens -------------------------------------------------------------------------------------

def _departure(r32: ReferenceResult, run: _PortPrompt, band: float, structural: set, ulp_floor: bool):
    """Classify where the free-running sequence first departs from the reference, or None."""
    tokens, ref = run.free.tokens, r32.generated
    if tokens == ref:
        return None
    s = next(i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b)
    dev, forced_choice = tokens[s], int(run.forced.step_logits[s].argmax())
    if dev != int(run.free.step_logits[s].argmax()) or dev != forced_choice:
        return TokenVerdict(s, ref[s], dev, math.nan, math.nan, "unexplained",
                            f"the free run chose {dev} at step {s}, but the argmax of its logits is "
                            f"{int(run.free.step_logits[s].argmax())} and the same prefix teacher-forced "
                            f"gives {forced_choice}")
    capped = r32.captures.get("step_capped_logits")
    if capped is not None and saturation_tie(capped[s], dev):
        return TokenVerdict(s, ref[s], dev, 0.0, 0.0, "saturation_tie",
                            "the device's raw argmax is among the reference's capped maxima (softcap saturates)")
    return classify_mismatch(s, r32.step_logits[s], dev, band, ref[s], s in structural, ulp_floor)


def _tokens(stage, spec, k, run: _PortPrompt, r32, band: float, structural: dict) -> PromptOutcome:
    cap, bf16 = spec.final_logit_softcapping, stage == "bf16"
    if not bf16:  # fp32: a tie only within fp32 rounding of this prompt's logits
        band = FP32_TIE_FRACTION * float(r32.captures["logits"].abs().max())
    pre, forced = run.forced.prefill, run.forced
    prefill = compare_logits(pre.logits, r32.captures["logits"], None, cap, band=band,
                             structural=structural.get((k, "prefill"), set()),
                             ref_capped=r32.captures.get("capped_logits"), dev_probs=run.prefill_probs, ulp_floor=bf16)
    decode = compare_logits(forced.step_logits, r32.step_logits, None, cap, ref_tokens=r32.generated, band=band,
                            structural=structural.get((k, "decode"), set()),
                            ref_capped=r32.captures.get("step_capped_logits"), dev_probs=run.step_probs,
                            ulp_floor=bf16)
    departure = _departure(r32, run, band, structural.get((k, "decode"), set()), bf16)
    return PromptOutcome(prompt=r32.prompt, reference_tokens=r32.generated, device_tokens=run.free.tokens,
                         prefill=prefill, decode=decode, departure=departure)


def structural_flips(fp32: "CheckResult | None") -> dict:
    """(prompt, "prefill"|"decode") -> rows where the fp32 port's token differs from the reference."""
    flips: dict = {}
    for k, pr in enumerate(fp32.prompts if fp32 else []):
        flips[(k, "prefill")] = {m.position for m in pr.prefill.mismatches}
        flips[(k, "decode")] = {m.position for m in pr.decode.mismatches}
        if pr.departure is not None:
            flips[(k, "decode")].add(pr.departure.position)
    return flips


# ---- one stage ----------------------------------------------------------------------------------

def run_stage(stage: str, engine, spec, ref32: list[ReferenceResult], ref16: list[ReferenceResult],
              calibration: NearTieCalibration, structural: dict | None = None, backend: str = "cpu", tp: int = 2,
              dtype: str = "bfloat16", progress: bool = False) -> CheckResult:
    """Every prompt through the engine (prefill with captures and cache reads, teacher-forced decode
    with captures, free greedy decode, host probabilities), judged by the stage's judge: fp32
    precision ("fp32") or the bf16 envelope ("bf16")."""
    say = status(f"{backend} {stage}", progress, total=len(ref32))
    runs, outcomes, points = [], [], _Points()
    for k, (r32, r16) in enumerate(zip(ref32, ref16)):
        say(f"prompt {k + 1}/{len(ref32)}: prefill, decode {len(r32.generated)} tokens")
        run = run_port_prompt(engine, r32, f"{stage} stage, prompt {k} ({len(r32.prompt)} tokens)")
        runs.append(run)
        _prefill_points(points, spec, k, run, r32, r16)
        _decode_points(points, spec, k, run, r32, r16)
        outcomes.append(_tokens(stage, spec, k, run, r32, calibration.band, structural or {}))
    dev, ref, env = points.stacked()
    judge = _judge(stage)
    notes = [] if hasattr(engine.backend, "read_cache") else [
        f"{stage} stage: the {backend} backend cannot read its KV cache; the cache is judged in the fp32 stage"]
    if not any(n.startswith("decode.layers.") for n in dev) and any(r.generated for r in ref32):
        notes.append(f"{stage} stage: the reference has no per-layer decode captures (an older golden?); "
                     "decode is judged at its logits only")
    same_dtype = ref16 if dtype == "bfloat16" else ref32
    exact = all(torch.equal(run.forced.prefill.captures["embeddings"], r.captures["embeddings"])
                for run, r in zip(runs, same_dtype))
    point = {n: judge(n, dev[n], ref[n], env[n]) for n in ("embeddings", "final_norm", "logits", "decode_logits",
                                                          "decode.embeddings", "decode.final_norm") if n in dev}
    return CheckResult(
        backend=backend, tp=tp, dtype=dtype, stage=stage, embeddings_exact=exact, embeddings=point["embeddings"],
        layers=_layers(spec, judge, dev, ref, env, routing=stage == "fp32"), final_norm=point["final_norm"],
        logits=point["logits"],
        decode_logits=point.get("decode_logits"), prompts=outcomes, calibration=calibration,
        decode_layers=_layers(spec, judge, dev, ref, env, "decode.", routing=stage == "fp32"),
        decode_points=[point[n] for n in ("decode.embeddings", "decode.final_norm") if n in point],
        kv=[judge(n, dev[n], ref[n], env[n]) for n in dev if n.startswith(("kv.", "decode.kv."))],
        probabilities=_probabilities(stage, runs, ref32, ref16), row_labels=points.labels, notes=notes,
        device_captures={n: t for n, t in dev.items() if not n.startswith(("decode", "kv."))})


# ---- the check ----------------------------------------------------------------------------------

def check_inputs_fit(engine, refs: list[ReferenceResult]) -> None:
    """Bad input is told apart from a port failure before the port runs: every prompt fits a
    bucket and, with its new tokens, the KV length."""
    for k, r in enumerate(refs):
        n, new = len(r.prompt), len(r.generated)
        if n > max(engine.buckets):
            raise PromptError(f"prompt {k} has {n} tokens, more than the largest prefill bucket "
                              f"({max(engine.buckets)}); pass --buckets with a bucket of at least {n} "
                              f"(and a --kv-len that holds it) or shorten the prompt")
        if n + new > engine.kv_len + 1:
            raise PromptError(f"prompt {k}: {n} tokens + {new} new tokens exceed the KV length "
                              f"{engine.kv_len}; pass a larger --kv-len or fewer --new-tokens")


def near_tie_calibration(ref32: list[ReferenceResult], ref16: list[ReferenceResult]) -> NearTieCalibration:
    """The near-tie band from the references alone: every prompt's prefill rows and decode steps."""
    pairs = [(a.captures["logits"], b.captures["logits"]) for a, b in zip(ref32, ref16)]
    pairs += [(a.step_logits, b.step_logits) for a, b in zip(ref32, ref16) if a.step_logits is not None]
    return calibrate_near_ties(pairs)


def build_fp32_engine(checkpoint, engine, backend: str):
    """The port in fp32 for the structural stage: on the backend itself when it runs on the host
    (cpu, xla), else on the CPU backend, with the engine's TP degree, buckets and KV length."""
    from harness.backends import build_engine

    name = backend if backend in ("cpu", "xla") else "cpu"
    return build_engine(checkpoint, backend=name, tp=getattr(engine.backend, "tp", 2), dtype=torch.float32,
                        buckets=engine.buckets, kv_len=engine.kv_len, capture=True)  # a parity build


def fp32_structural_stage(checkpoint, ref32, ref16, backend: str = "cpu", tp: int = 2, buckets=(64, 256),
                          kv_len: int = 256, progress: bool = False) -> CheckResult:
    """The fp32 stage alone (what `bisect` adds to its search): the port in fp32 on the host
    backend against the fp32 reference; an exception inside the port is a failed stage."""
    from harness.backends import build_engine

    name = backend if backend in ("cpu", "xla") else "cpu"
    try:
        engine = _port_call("fp32 stage: building the fp32 port", build_engine, checkpoint, backend=name, tp=tp,
                            dtype=torch.float32, buckets=buckets, kv_len=kv_len, capture=True)  # a parity build
        check_inputs_fit(engine, ref32)
        return run_stage("fp32", engine, checkpoint.spec, ref32, ref16, near_tie_calibration(ref32, ref16), None,
                         backend, tp, "float32", progress)
    except PortFailure as failure:
        return CheckResult(backend=backend, tp=tp, dtype="float32", stage="fp32", port_error=failure.describe())


def _fp32_stage(checkpoint, engine, ref32, ref16, calibration, fp32_engine, backend, tp, dtype, progress):
    try:
        if fp32_engine == "auto":
            fp32_engine = engine if dtype == "float32" else _port_call(
                "fp32 stage: building the fp32 port", build_fp32_engine, checkpoint, engine, backend)
        return run_stage("fp32", fp32_engine, checkpoint.spec, ref32, ref16, calibration, None, backend, tp,
                         "float32", progress)
    except PortFailure as failure:
        return CheckResult(backend=backend, tp=tp, dtype="float32", stage="fp32", port_error=failure.describe())


def check_port(checkpoint, engine, ref32: list[ReferenceResult], ref16: list[ReferenceResult],
               backend: str = "cpu", tp: int = 2, dtype: str = "bfloat16", local: bool | None = None,
               progress: bool = False, fp32_engine="auto") -> CheckResult:
    """Both stages: the fp32 structural stage (`fp32_engine`: "auto" builds it, None skips it),
    then the bf16 envelope stage on `engine` with flips the fp32 stage shows marked structural,
    plus (by default wherever the backend's ranks run on CPU) the local verdict of every layer. An
    exception inside the port is a failed result naming where it was raised."""
    check_inputs_fit(engine, ref32)
    calibration = near_tie_calibration(ref32, ref16)
    fp32 = None
    if fp32_engine is not None:
        fp32 = _fp32_stage(checkpoint, engine, ref32, ref16, calibration, fp32_engine, backend, tp, dtype, progress)
    try:
        result = run_stage("bf16", engine, checkpoint.spec, ref32, ref16, calibration, structural_flips(fp32),
                           backend, tp, dtype, progress)
        if local is None:
            local = hasattr(engine.backend, "on_ranks")
        if local:
            port_run = PortRun(result.device_captures, result.seq_match, result.near_ties, result.divergences)
            verdicts, _ = _port_call("bf16 stage: local layer verdicts", local_verdicts, checkpoint, engine.backend,
                                     ref32, ref16, port_run, progress)
            result.local = [{"index": v.index, "pass": v.passed, "component": v.component,
                             "ratio": max(p.required_factor for p in v.judged)} for v in verdicts]
        else:
            result.notes.append("local (reference-fed) layer verdicts need the CPU backend's ranks; "
                                "run `gemma-parity bisect` to pin a layer on this backend")
    except PortFailure as failure:
        result = CheckResult(backend=backend, tp=tp, dtype=dtype, stage="bf16", port_error=failure.describe(),
                             calibration=calibration)
    result.fp32 = fp32
    if fp32 is None:
        result.notes.append("fp32 structural stage skipped")
    return result


def load_reference_source(checkpoint, checkpoint_dir, golden=None, prompts=None):
    """The golden (read and verified against the checkpoint's spec) or the validated prompts:
    every input checked before any expensive work starts. `golden` may be a Golden already read
    and `prompts` token-id lists already loaded (the command's validation pass did it): they are
    not read again."""
    from harness.golden import Golden, read_golden
    from harness.prompts import load_prompts, validate_prompt_ids

    if isinstance(golden, Golden):
        return golden
    if golden:
        return read_golden(golden, expected_spec=checkpoint.spec)
    loaded = prompts if isinstance(prompts, list) else load_prompts(prompts, checkpoint_dir)
    validate_prompt_ids(checkpoint.spec, loaded, None if isinstance(prompts, list) else prompts)
    return loaded


def load_references(source, checkpoint_dir, new_tokens: int, progress: bool = False):
    """(fp32, bf16) reference results: from a golden, or computed now for the prompts."""
    from harness.golden import Golden
    from harness.reference import run_reference

    if isinstance(source, Golden):
        return source.results("float32"), source.results("bfloat16")
    refs = run_reference(checkpoint_dir, source, new_tokens, progress=progress)
    return refs["float32"], refs["bfloat16"]


def run_parity_check(checkpoint, checkpoint_dir, golden=None, prompts=None, backend: str = "cpu", tp: int = 2,
                     dtype: torch.dtype = torch.bfloat16, new_tokens: int = 8, buckets=(64, 256), kv_len: int = 256,
                     progress: bool = False, fp32_stage: bool = True) -> CheckResult:
    """What `gemma-parity check` does: the port on `backend` against the reference (recomputed
    for `prompts`, or read from `golden`), judged in two stages."""
    from harness.backends import build_engine
    from harness.reference import dtype_name

    source = load_reference_source(checkpoint, checkpoint_dir, golden, prompts)
    new = getattr(source, "new_tokens", new_tokens)
    check_inputs_fit(SimpleNamespace(buckets=tuple(buckets), kv_len=kv_len),
                     [ReferenceResult(p, "", {}, [0] * new) for p in getattr(source, "prompts", source)])
    # The backend before the reference: a missing SDK or a bad TP degree is reported before minutes
    # of reference work, and loading the shards checks every weight for NaN/Inf (Checkpoint.get)
    # before transformers (which does not) computes the reference. A parity build: the per-layer
    # captures are extra graph outputs on the device.
    engine = build_engine(checkpoint, backend=backend, tp=tp, dtype=dtype, buckets=buckets, kv_len=kv_len,
                          capture=True)
    ref32, ref16 = load_references(source, checkpoint_dir, new_tokens, progress)
    return check_port(checkpoint, engine, ref32, ref16, backend=backend, tp=tp, dtype=dtype_name(dtype),
                      progress=progress, fp32_engine="auto" if fp32_stage else None)
