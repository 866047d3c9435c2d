"""Over-precision: a point whose R (distribution.py) sits well below 1 across its
positions computes more precisely than the bf16 model it claims to be (an extra `.float()`, a scale
applied in fp32 where the model casts it first): the device and the bf16 reference part ways there,
and the device pays for precision nobody asked for. Named at the first point (layer and part) in run
order where it starts, with what it costs; a warning, a failure under `--strict-precision`."""

from __future__ import annotations

from dataclasses import dataclass

from harness.base.points import Point
from harness.judge.ratios import MIN_POSITIONS, finite_r

# A point is over-precise when the median of its R over at least MIN_POSITIONS positions is below
# OVER_PRECISION_LIMIT. Where from: the healthy census's lowest median of a point is
# OVER_PRECISION_HEALTHY_MIN (`python -m tests.census.distribution`); the embedding scale applied in
# fp32 (embed-scale-not-cast) reads 0.81 at the embeddings, and the catalog's over-precision twins
# (tests/faults/catalog.py PRECISION_CATALOG) 0.0-0.8 at their points.
OVER_PRECISION_HEALTHY_MIN = 0.95
OVER_PRECISION_LIMIT = 0.9
BF16_BYTES, FP32_BYTES = 2, 4
# Parts whose R is not a precision reading below 1: the gated per-layer input is judged against its
# pooled envelope (compare.POOLED_PARTS: R below 1 by construction, median 0.13-0.76 on the healthy
# census), the MoE router's chosen-expert weights are dense over experts (healthy medians below 0.9).
NOT_JUDGED = ("per_layer_input", "expert_weights")


@dataclass
class OverPrecision:
    """One over-precise point: its median R, over how many positions, and what it costs."""

    point: str
    scope: str  # cumulative | local
    median: float
    positions: int
    lanes: int

    @property
    def where(self) -> str:
        if self.point.startswith("served."):
            return "the served build (its step logits)"
        p = Point.parse(self.point)
        return f"layer {p.layer} ({p.part})" if p.in_layer else self.point

    def cost(self) -> str:
        extra = (FP32_BYTES - BF16_BYTES) * self.lanes
        return (f"{self.lanes} values a position held in fp32 where bf16 was due: {extra} more bytes a token "
                f"at this point, and the work that reads it at fp32's rate")

    def describe(self) -> str:
        if self.scope == "bitwise":  # harness/judge/bitwise.py: the layer alone departs from transformers' bits
            found = (f"departs from transformers' bf16 layer alone, and its departing elements' median R is "
                     f"{self.median:.3f}, below 1 (a rounding later than the model's)")
        else:
            found = (f"median R {self.median:.3f} over {self.positions} positions, below {OVER_PRECISION_LIMIT:g} "
                     "(the port is closer to fp32 than bf16 can be)")
        return f"{self.point} ({self.where}, {self.scope}): {found}; cost: {self.cost()}"

    def failure(self) -> dict:
        return {"point": self.point, "ratio": self.median, "where": f"{self.where}, {self.scope}",
                "detail": f"over-precision: {self.describe()}"}

    def to_json(self) -> dict:
        return {"point": self.point, "where": self.where, "scope": self.scope, "median": self.median,
                "positions": self.positions, "lanes": self.lanes,
                "extra_bytes_per_token": (FP32_BYTES - BF16_BYTES) * self.lanes}


def over_precise(point, scope: str) -> OverPrecision | None:
    r = finite_r([point])
    if r.numel() < MIN_POSITIONS:
        return None
    median = float(r.median())
    if median >= OVER_PRECISION_LIMIT:
        return None
    return OverPrecision(point.name, scope, median, int(r.numel()), int(getattr(point, "lanes", 0)))


def find_over_precision(cumulative, local) -> list[OverPrecision]:
    """Every over-precise point in run order (the first names where it starts): the layers' points
    alone on the reference's input (the local verdicts: without them a layer's over-precision is not
    judged), the points outside the layers (the embeddings, the final norm, the logits) in the port's
    prefill. Not the layers cumulatively, nor teacher-forced decode: there a healthy port's R
    compounds and its few decode rows are alike (the census saw healthy points at medians of 0.85 at
    the last layer's decode KV cache)."""
    found = [over_precise(p, scope) for scope, p in judged_points(cumulative, local)]
    found = [o for o in found if o is not None]
    return sorted(found, key=lambda o: (_order(o.point), o.scope != "local"))


def judged_points(cumulative, local) -> list[tuple[str, object]]:
    """(scope, point) of every point over-precision is judged at (find_over_precision), NOT_JUDGED left out."""
    outside = [p for p in cumulative if not Point.parse(p.name).decode and not Point.parse(p.name).in_layer]
    points = [("local", p) for p in local] + [("cumulative", p) for p in outside]
    return [(scope, p) for scope, p in points if Point.parse(p.name).part not in NOT_JUDGED]


def _order(name: str) -> tuple:
    """Run order: embeddings, then layer by layer, then the final norm and logits; decode after prefill."""
    p = Point.parse(name)
    rank = {"embeddings": 0, "layer": 1, "kv": 1, "final_norm": 2, "logits": 3, "probabilities": 4}[p.kind]
    return (p.decode, rank, p.layer if p.layer is not None else -1)


def served_over_precision(stages) -> list[OverPrecision]:
    """The served build's own over-precision (harness/parity/served.py judges its step logits with
    compare_point, which leaves R on them): the served graph computing its logits closer to fp32 than
    bf16 can be, with what that costs a token (a vocabulary of values in fp32)."""
    found = [over_precise(s.step_logits, "served") for s in stages
             if getattr(s, "stage", None) == "served" and getattr(s, "step_logits", None) is not None]
    return [o for o in found if o is not None]


def flagged_over_precision(own: list[OverPrecision], stages) -> list[OverPrecision]:
    """Every over-precision a check flags: `own` (R's, find_over_precision) with the bit-exact layer
    stage's (harness/judge/bitwise.py: a departure from transformers' bf16 layer rounding later), in run
    order, then the served build's (read from the check's extra stages once attached)."""
    bitwise = [o for s in stages if getattr(s, "stage", None) == "bitwise_layers" for o in s.over_precision]
    return sorted(own + bitwise, key=lambda o: (_order(o.point), o.scope != "local")) + served_over_precision(stages)
