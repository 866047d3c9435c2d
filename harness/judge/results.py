"""The fp32 and bf16 stages' results (`ParityStage`, a harness.judge.stage_result.StageResult like every
stage of `check`): plain data per stage (its points, tokens, probabilities, local verdicts), with the
decisions that read it (what failed, where, its first failing layer). harness.judge.check_result holds
the check's result (its run's settings and its sealed stages)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.base.points import Point
from harness.judge.stage_result import Gate, StageResult, blame, divergent
from harness.judge.verdicts import LayerResult, LogitsResult, NearTieCalibration, PointResult, ProbabilityResult, TokenVerdict


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
        return self.seq_match or (self.departure is not None and self.departure.accounted)

    @property
    def near_ties(self) -> int:
        return self.prefill.near_ties + self.decode.near_ties

    @property
    def divergences(self) -> int:
        return self.prefill.divergences + self.decode.divergences

    def to_json(self) -> dict:
        return {"prompt_length": len(self.prompt), "reference_tokens": self.reference_tokens,
                "device_tokens": self.device_tokens, "seq_match": self.seq_match,
                "first_mismatch": self.first_mismatch, "prefill_logits": self.prefill.to_json(),
                "decode_logits_teacher_forced": self.decode.to_json(),
                "departure": asdict(self.departure) if self.departure else None,
                "accounted": self.accounted}


@dataclass
class LocalLayer:
    """One layer alone on the reference's input to it (the local verdict)."""

    index: int
    passed: bool
    component: str | None
    ratio: float
    rel_l2: float | None = None  # the layer's output alone, and its local envelope
    envelope_rel_l2: float | None = None

    def to_json(self) -> dict:
        return {"index": self.index, "pass": self.passed, "component": self.component, "ratio": self.ratio}


@dataclass(eq=False)
class ParityStage(StageResult):
    """The fp32 (structural) or bf16 (envelope) stage of a check: the port observed whole and judged
    point by point and token by token (harness.judge.stage.judge_stage). Its one gate holds every
    failure of the stage in run order; it is sealed once its local verdicts are in."""

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
    local: list[LocalLayer] | None = None
    notes: list[str] = field(default_factory=list)
    stage: str = "bf16"  # "fp32" (structural) or "bf16" (envelope)
    kv: list[PointResult] = field(default_factory=list)  # kv.{i}.k/v after prefill, decode.kv.* after steps
    decode_layers: list[LayerResult] = field(default_factory=list)  # teacher-forced decode, per layer
    decode_points: list[PointResult] = field(default_factory=list)  # decode.embeddings, decode.final_norm
    probabilities: list[ProbabilityResult] = field(default_factory=list)
    calibration: NearTieCalibration | None = None
    port_error: dict | None = None  # an exception raised inside the port: a parity failure
    row_labels: dict[str, list[str]] = field(default_factory=dict, repr=False)
    judge: str = "bf16 envelope"
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase of this stage
    # The observation judged here (harness.parity.observe), for what is judged after the stage (the local
    # verdicts, bisect): not part of the result's data.
    observation: object = field(default=None, repr=False, compare=False)
    # The stage's references when the port raised (no observation): a snapshot of the raising step reads them.
    references: object = field(default=None, repr=False, compare=False)
    local_verdicts: list = field(default_factory=list, repr=False, compare=False)  # local.LayerVerdict
    local_nonfinite: dict | None = field(default=None, repr=False, compare=False)
    # transformers' layers alone as the local verdicts ran them (harness.reference.layers.ReferenceLayers):
    # the runs it kept serve the bit-exact stage, which reads the same inputs
    reference_layers: object = field(default=None, repr=False, compare=False)
    # MoE models, bf16 stage: the port's router choices judged (harness.judge.routing.RoutingResult)
    routing: object = None
    ran = True

    @property
    def seq_match(self) -> bool:
        return all(p.seq_match for p in self.prompts)

    def first_layer_failure(self) -> tuple[int, str] | None:
        """(layer, component) of the first failing point in run order that belongs to a layer."""
        for p in self.all_points():
            point = Point.parse(p.name)
            if point.in_layer and self.point_failed(p):
                return point.layer, point.component
        return None

    def divergent(self) -> tuple[int, str] | None:
        """This stage's first divergent (layer, component) alone (stage_result.divergent holds the rule;
        the check's reads the fp32 stage beside the bf16 one: check_result.CheckResult.divergent)."""
        return divergent(self)

    def point_failed(self, p) -> bool:
        """A point broke its judge, or (MoE, bf16 stage) the port's routing there diverged."""
        return not p.passed or (self.routing is not None and self.routing.diverges_at(p.name))

    @property
    def near_ties(self) -> int:
        return sum(p.near_ties for p in self.prompts)

    @property
    def divergences(self) -> int:
        return sum(p.divergences for p in self.prompts)

    def all_points(self) -> list[PointResult]:
        """Every capture point of this stage, in run order: per layer its KV cache (written inside
        its attention) before its residual points; prefill, then the decode steps."""
        kv: dict[tuple[bool, int], list[PointResult]] = {}
        for p in self.kv:
            point = Point.parse(p.name)
            kv.setdefault((point.decode, point.layer), []).append(p)

        def per_layer(layers: list[LayerResult], decode: bool) -> list[PointResult]:
            return [p for layer in layers for p in kv.get((decode, layer.index), []) + layer.points]

        decode_layers = self.decode_layers or [LayerResult(i, "", []) for d, i in sorted(kv) if d]
        prefill = ([self.embeddings] if self.embeddings else []) + per_layer(self.layers, False)
        prefill += [p for p in (self.final_norm, self.logits) if p is not None]
        decode = self.decode_points[:1] + per_layer(decode_layers, True)
        decode += self.decode_points[1:] + ([self.decode_logits] if self.decode_logits else [])
        return prefill + decode

    def gates(self) -> list[Gate]:
        """One gate, the stage's own name: every failure of the stage, in run order."""
        return [Gate(self.stage, self._judged_failures())]

    def _judged_failures(self) -> list[dict]:
        """What fails in this stage, in run order: each with the stage, the point and where."""
        if self.port_error:
            return [dict(self.port_error, stage=self.stage, point="exception inside the port")]
        out = []
        if not self.embeddings_exact:
            out.append({"stage": self.stage, "point": "embeddings", "where": "the host lookup",
                        "detail": f"not bit-exact with the {self.dtype} reference's lookup"})
        for p in self.all_points() + self.probabilities:
            if self.routing is not None and self.routing.diverges_at(p.name):
                out += [f for f in self.routing.failures(self.stage) if f["point"] == p.name]
            if not p.passed:
                factor = p.required_factor if isinstance(p, PointResult) else p.ratio
                out.append({"stage": self.stage, "point": p.name, "ratio": _finite(factor),
                            "where": self.row_label(p.name, p.worst_position)})
        out += [{"stage": self.stage, "point": f"layer {v.index} alone ({v.component})", "ratio": v.ratio,
                 "where": "local verdict"} for v in self.local or [] if not v.passed]
        for k, pr in enumerate(self.prompts):
            for part, lg in (("prefill", pr.prefill), ("decode", pr.decode)):
                out += [{"stage": self.stage, "point": f"{part} token", "where": f"prompt {k} row {m.position}",
                         "detail": m.evidence} for m in lg.mismatches if m.kind == "divergence"]
            if not pr.accounted and not any(m.kind == "divergence" for m in pr.decode.mismatches):
                d = pr.departure
                out.append({"stage": self.stage, "point": "sequence", "where": f"prompt {k} step {pr.first_mismatch}",
                            "detail": d.evidence if d else "unclassified sequence mismatch"})
        return out

    def row_label(self, name: str, row: int) -> str:
        # a point's own labels first (a ring layer's KV rows are only its last window positions)
        labels = self.row_labels.get(name) or self.row_labels.get(Point.parse(name).rows, [])
        return labels[row] if 0 <= row < len(labels) else f"row {row}"

    def layer_json(self, layer: LayerResult, fp32: "ParityStage | None" = None) -> dict:
        """A layer's row: its points in the port's run, its local verdict beside them. A layer that
        fails only cumulatively while passing alone carries upstream error: it is not blamed
        ("pass" stays its local verdict's, "component" None, "carries_upstream_error" true)."""
        out = layer.to_json()
        out["cumulative_ratio"] = max(out["ratio"], out["position_ratio"])
        local = next((v for v in self.local or [] if v.index == layer.index), None)
        if local is not None:
            out["local_ratio"], out["local_pass"] = local.ratio, local.passed
            out["local_rel_l2"], out["local_envelope_rel_l2"] = local.rel_l2, local.envelope_rel_l2
        out.update(blame(out["pass"], local))
        if fp32 is not None:
            out.update(fp32.layer_verdict(layer.index))
        return out

    def layer_verdict(self, index: int) -> dict:
        """This stage's verdict on one layer (the fp32 column of check's table): every point of the
        layer in the stage (prefill, KV, decode), its worst ratio to the stage's envelope and the
        part that fails first."""
        points = [p for p in self.all_points() if Point.parse(p.name).in_layer and Point.parse(p.name).layer == index]
        failed = [p.name for p in points if self.point_failed(p)] + (["exception inside the port"] if self.port_error else [])
        worst = max((p.required_factor for p in points), default=None)
        return {f"{self.stage}_ratio": None if worst is None else _finite(worst), f"{self.stage}_pass": not failed,
                f"{self.stage}_point": failed[0] if failed else None}

    def stage_json(self) -> dict:
        return {"stage": self.stage, "dtype": self.dtype, "passed": self.passed, "judge": self.judge,
                "failures": self.failures(), "points": len(self.all_points()) + len(self.probabilities),
                "port_error": self.port_error, "notes": self.notes, "seconds": self.seconds,
                "kv_points": [asdict(p) for p in self.kv],
                "decode_layers": [layer.to_json() for layer in self.decode_layers],
                "decode_points": [asdict(p) for p in self.decode_points],
                "probabilities": [asdict(p) for p in self.probabilities],
                "near_tie_calibration": asdict(self.calibration) if self.calibration else None,
                "routing": self.routing.to_json() if self.routing is not None else None,
                "seq_match": self.seq_match, "prompts": [p.to_json() for p in self.prompts]}


def _finite(x: float) -> float | None:
    import math

    return x if math.isfinite(x) else None
