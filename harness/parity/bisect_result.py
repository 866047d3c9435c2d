"""The result of `bisect`: per layer the cumulative and local verdicts, the first point that
breaks the policy, its component and cause. In capture mode the first divergent layer, the token
counts and the verdict are the check's own (the check it ran is attached)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.base.points import KV_PARTS, Point, first_component, locate
from harness.judge.compare import ENVELOPE_FACTOR
from harness.judge.verdicts import PointResult
from harness.judge.layers import LayerVerdict, _finite_or_none


@dataclass
class BisectResult:
    mode: str
    backend: str
    tp: int
    dtype: str
    num_layers: int
    layers: list[LayerVerdict]
    builds: int
    nonfinite: dict | None = None
    seq_match: bool | None = None
    near_tie_flips: int | None = None
    real_divergences: int | None = None
    first_failing_prefix: int | None = None  # truncate mode: the smallest k whose output fails
    notes: list[str] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)  # rows are the prompts' positions, stacked
    # capture mode: the points around the layers. The host embedding lookup against the golden's,
    # and the final norm in the port's run and alone on the golden's last layer output.
    embeddings: PointResult | None = None
    final_norm: list[PointResult] = field(default_factory=list)
    # The fp32 structural stage (harness.parity.check): the port in fp32 against the golden's fp32
    # reference to fp32 precision. A structural bug inside bf16 noise fails here.
    fp32_stage: dict | None = None
    # capture mode: the check this bisection read its layers, tokens and stages from (not JSON)
    check: object = field(default=None, repr=False, compare=False)

    def _first_point(self) -> tuple[str, LayerVerdict | None] | None:
        """(name, layer) of the first point that breaks the policy, in this order: embeddings; the
        first layer whose local error breaks it; the final norm alone; then, when nothing is wrong
        on its own, the first layer (or the final norm) whose cumulative error breaks it."""
        if self.embeddings is not None and not self.embeddings.passed:
            return "embeddings", None
        if self.mode == "truncate":
            if self.first_failing_prefix is None:
                return None
            bad = next(v for v in self.layers if v.index == self.first_failing_prefix - 1)
            return f"layers.{bad.index}", bad
        found = self.check.divergent() if self.check is not None else None
        bad = next((v for v in self.layers if not v.passed), None)
        if found is not None:  # the check's own rule: the first layer failing alone, else in the run
            bad = next(v for v in self.layers if v.index == found[0])
            return f"layers.{bad.index}", bad
        if bad is not None:
            return f"layers.{bad.index}", bad
        if self.final_norm and not self.final_norm[-1].passed:
            return "final_norm", None
        bad = next((v for v in self.layers if not v.cumulative_passed), None)
        if bad is not None:
            return f"layers.{bad.index}", bad
        if self.final_norm and not self.final_norm[0].passed:
            return "final_norm", None
        return None

    @property
    def first_divergent_point(self) -> str | None:
        first = self._first_point()
        return None if first is None else first[0]

    @property
    def first_bad(self) -> LayerVerdict | None:
        first = self._first_point()
        return None if first is None else first[1]

    @property
    def first_divergent_layer(self) -> int | None:
        bad = self.first_bad
        return None if bad is None else bad.index

    @property
    def component(self) -> str | None:
        bad = self.first_bad
        if bad is None:
            return None
        found = self.check.divergent() if self.check is not None else None
        if found is not None and found[0] == bad.index:
            return found[1]
        return bad.component or first_component(bad.cumulative)

    @property
    def cause(self) -> str | None:
        """nonfinite | weights (the port computes this checkpoint right; the checkpoint differs
        from the golden's here) | port (the port's layer differs from transformers on the same
        weights, alone in bf16 or in the fp32 structural stage) | accumulated (nothing wrong alone) | divergent (truncate: not told apart) |
        embeddings | final_norm."""
        first = self._first_point()
        if first is None:
            return None
        name, bad = first
        if bad is None:
            points = [self.embeddings] if name == "embeddings" else self.final_norm
            if not all(p.finite for p in points):
                return "nonfinite"
            return name if name == "embeddings" or not self.final_norm[-1].passed else "accumulated"
        if not all(p.finite for p in bad.judged):
            return "nonfinite"
        if self.mode == "truncate":
            return "divergent"
        if bad.passed:  # nothing wrong alone in bf16: the port's unless the fp32 stage pins it here
            structural = self.check.fp32.divergent() if self.check is not None and self.check.fp32 else None
            return "port" if structural is not None and structural[0] == bad.index else "accumulated"
        return "weights" if bad.port_matches_checkpoint else "port"

    @property
    def passed(self) -> bool:
        return (self._first_point() is None and (self.fp32_stage is None or self.fp32_stage["passed"])
                and (self.check is None or self.check.passed))

    def to_json(self) -> dict:
        layers = [v.to_json() for v in self.layers]
        edges = {"embeddings": asdict(self.embeddings) if self.embeddings else None,
                 "final_norm": dict(zip(("cumulative", "local"), (asdict(p) for p in self.final_norm))) or None}
        self._locate_positions([p for layer in layers for p in layer["cumulative_points"] + layer["local_points"]]
                               + [p for p in [edges["embeddings"], *(edges["final_norm"] or {}).values()] if p])
        return _finite_or_none({
            "passed": self.passed, "mode": self.mode, "backend": self.backend, "tp": self.tp,
            "dtype": self.dtype, "num_layers": self.num_layers,
            "first_divergent_layer": self.first_divergent_layer, "component": self.component,
            "first_divergent_point": self.first_divergent_point, "cause": self.cause, "builds": self.builds,
            "nonfinite": self.nonfinite, "first_failing_prefix": self.first_failing_prefix,
            "seq_match": self.seq_match, "near_tie_flips": self.near_tie_flips,
            "real_divergences": self.real_divergences, "tolerance_factor": ENVELOPE_FACTOR,
            "prompt_lengths": self.prompt_lengths, **edges, "layers": layers, "notes": self.notes,
            "fp32_stage": self.fp32_stage, "diagnosis": self.diagnosis(),
        })

    def diagnosis(self) -> dict | None:
        """What the report's picture shows, as data: which of the first bad layer's points fail
        (keys and values in the port's run from the check; the residuals alone on the golden's input,
        else in the run) and, in capture mode, how many layers of each type fail alone."""
        bad = self.first_bad
        if bad is None:
            return None
        def layer_kv(stage) -> list:
            return [p for p in (stage.kv if stage is not None else []) if Point.parse(p.name).layer == bad.index]

        # the bf16 stage's KV, or the fp32 stage's where only that one fails there
        stage, fp32 = (self.check.bf16, self.check.fp32) if self.check is not None else (None, None)
        if stage is not None and fp32 is not None and all(p.passed for p in layer_kv(stage)) and not all(
                p.passed for p in layer_kv(fp32)):
            stage = fp32
        kv = layer_kv(stage)
        parts: dict[str, list] = {}
        for p in kv + bad.judged:
            parts.setdefault(Point.parse(p.name).part, []).append(p)
        points = [{"part": part, "passed": all(p.passed for p in ps),
                   "ratio": max(p.required_factor for p in ps), "points": [p.name for p in ps],
                   "where": "port's run" if part in KV_PARTS or not bad.local else "alone on the golden's input"}
                  for part, ps in parts.items()]
        by_type = {}
        if self.mode == "capture":
            for v in self.layers:
                counts = by_type.setdefault(v.type, {"layers": 0, "fail_alone": 0})
                counts["layers"] += 1
                counts["fail_alone"] += not v.passed
        return {"layer": bad.index, "type": bad.type, "points": points, "by_type": by_type,
                "kv_stage": stage.stage if stage is not None and kv else None}

    def _locate_positions(self, points: list[dict]) -> None:
        """Points' worst_position indexes the prompts' stacked rows: say which prompt and position."""
        for p in points:
            if p["worst_position"] < sum(self.prompt_lengths):
                p["worst_prompt"], p["worst_prompt_position"] = locate(p["worst_position"], self.prompt_lengths)


def fp32_summary(fp32) -> dict:
    """The fp32 structural stage (a check result) as bisect reports it."""
    found = fp32.divergent()
    return {"passed": fp32.passed, "failures": fp32.failures()[:20],
            "first_divergent_layer": found[0] if found else None,
            "first_divergent_component": found[1] if found else None}


