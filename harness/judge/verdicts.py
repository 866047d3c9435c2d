"""What the judge (compare.py) returns: plain data per capture point, layer, token and
distribution. Nothing here decides a verdict; compare.py does, and report/formats.py renders."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.base.points import first_component


@dataclass
class PointResult:
    """One capture point: the device against fp32, judged by the bf16 envelope."""

    # R per position (a tensor; compare.compare_point sets it): a plain attribute, not a field, so
    # that the JSON (asdict) stays one row per point; harness/judge/distribution.py reads it
    position_r = None
    lanes = 0  # values per position (the point's width), for what over-precision costs

    name: str
    rel_l2: float
    cosine: float
    max_abs: float
    envelope_rel_l2: float
    ratio: float  # whole-tensor error / envelope
    position_ratio: float  # worst position's error / worst position's envelope
    worst_position: int  # row of the prompts stacked in order (bisect maps it to prompt, position)
    finite: bool
    passed: bool

    @property
    def required_factor(self) -> float:
        """The tolerance factor (error / envelope) that would have let this point pass."""
        return max(self.ratio, self.position_ratio)

    def explain(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if not self.finite:
            return f"{self.name}: FAIL, device output has NaN or Inf"
        return (f"{self.name}: {verdict} rel_l2={self.rel_l2:.3e} (bf16 envelope "
                f"{self.envelope_rel_l2:.3e}, ratio {self.ratio:.2f}; worst row "
                f"{self.worst_position} ratio {self.position_ratio:.2f}), cosine={self.cosine:.6f}, "
                f"max_abs={self.max_abs:.3e}; would pass at a tolerance of "
                f"{self.required_factor:.2f}x")


@dataclass
class LayerResult:
    index: int
    type: str
    points: list[PointResult]

    @property
    def output(self) -> PointResult:
        return self.points[-1]

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.points)

    @property
    def component(self) -> str | None:
        """Which part of the layer first breaks the policy: attention (the attention residual
        point) or mlp (only the MLP residual or the scaled output)."""
        return first_component(self.points)

    def to_json(self) -> dict:
        out = self.output
        return {"index": self.index, "type": self.type, "rel_l2": out.rel_l2, "cosine": out.cosine,
                "max_abs": out.max_abs, "envelope_rel_l2": out.envelope_rel_l2, "ratio": out.ratio,
                "position_ratio": out.position_ratio, "pass": self.passed, "component": self.component,
                "points": [asdict(p) for p in self.points]}


@dataclass
class NearTieCalibration:
    """The tail band of one check: NEAR_TIE_FACTOR x the NEAR_TIE_QUANTILE (1: the largest) of how
    far bf16 moves the reference's top-1 margins against fp32, over every position and prompt."""

    quantile: float
    factor: float
    samples: int
    shift_at_quantile: float
    shift_max: float
    band: float

    def describe(self) -> str:
        at = "the largest" if self.quantile >= 1.0 else f"the {self.quantile:g} quantile"
        return (f"near-tie band {self.band:.3f} logits = {self.factor:g} x {at} ({self.shift_at_quantile:.3f}) of how "
                f"far bf16 moves the reference's top-1 margins against fp32 ({self.samples} margins over every "
                f"position and prompt; largest {self.shift_max:.3f}); the bf16 stage's departing tokens are decided "
                "on the port's own path")


@dataclass
class TokenVerdict:
    """A position where the device's choice differs from the reference's token, its class and the
    evidence for it."""

    position: int
    reference_token: int
    device_token: int
    margin: float  # how much the reference prefers its token over the device's (raw fp32 logits)
    threshold: float  # margins at or below this are near ties
    kind: str  # "near_tie" | "saturation_tie" | "divergence"
    evidence: str = ""

    @property
    def accounted(self) -> bool:
        """A tie (near or saturation) the check accepts as rounding, not a departure of the port's."""
        return self.kind in ("near_tie", "saturation_tie")


@dataclass
class LogitsResult:
    """Per-position agreement between device and reference logits (rows are positions)."""

    positions: int
    top1_agreement: float
    topk_overlap: float
    kl_mean: float
    kl_max: float
    mismatches: list[TokenVerdict] = field(default_factory=list)

    @property
    def near_ties(self) -> int:
        return sum(v.kind == "near_tie" for v in self.mismatches)

    @property
    def divergences(self) -> int:
        return sum(v.kind == "divergence" for v in self.mismatches)

    def to_json(self) -> dict:
        d = asdict(self)
        d["near_ties"], d["divergences"] = self.near_ties, self.divergences
        return d


@dataclass
class ProbabilityResult:
    """The host transform judged as a function: the host's served distribution (softcap + softmax)
    for the port's own raw logits against transformers' capped distribution of the same logits, row
    by row to fp32 precision (compare.compare_probabilities). KL(expected || host) and the top-k
    mass error are reported beside the judged relative error and total variation."""

    name: str
    rows: int
    kl_mean: float
    kl_max: float
    topk_mass_error: float  # largest |host mass - expected mass| on the expected top-k
    relative_error_max: float  # largest |host p - expected p| / expected p (expected p >= the floor)
    total_variation_max: float  # largest half L1 distance of a row
    ratio: float  # worst row's error over its tolerance (<= 1 passes)
    worst_position: int
    passed: bool

    def explain(self) -> str:
        return (f"{self.name}: {'PASS' if self.passed else 'FAIL'} host transform on the port's own logits, "
                f"{self.rows} rows: relative error max {self.relative_error_max:.3e}, total variation max "
                f"{self.total_variation_max:.3e} (KL max {self.kl_max:.3e}), {self.ratio:.2f}x the fp32 "
                f"tolerance at row {self.worst_position}")
