"""The bit-exact layer stage's verdict: the port's bf16 layer alone at TP 1 on the reference's input
against transformers' own bf16 layer on the same input, element by element.

At TP 1 on CPU the port runs the model's arithmetic with the model's shapes (the same projections,
norms, softmax and roundings, one chunk of exactly the prompt's rows), so a healthy port reproduces
transformers' bf16 layer bit for bit: the healthy census (every member whose layers run alone, the
12B's real widths included) departs at no element of any point. A rounding to bf16 earlier or later
than the model does it changes the rounding of a large share of a point's elements (the catalog's
precision-ordering faults: 14 % to 57 % at the point where they start), however wide the layer, where
R's median (harness/judge/distribution.py) moves by 2 % at hidden 64 and less than the census's own
spread. Which way the rounding moved is read on the departing elements alone: the median of
|port - fp32| / |bf16 reference - fp32| there is above 1 when the port rounds earlier (less precise: a
failure), well below 1 when it rounds later (over-precision: flagged by harness/judge/precision.py, a
failure under `--strict-precision`), and near 1 when it computes something else as precisely (a failure). The numbers and where they come from: docs/judging.md#the-bit-exact-layer-stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.base.points import Point
from harness.judge.precision import OverPrecision
from harness.judge.stage_result import Gate, StageResult

# A point departs when more than DEPARTURE_LIMIT of its elements differ from transformers' bf16 layer.
# Where from: the healthy census departs at no element of any point (HEALTHY_DEPARTURE, `python -m
# tests.census.bitwise`); the catalog's precision-ordering faults at 14 % or more of the point where
# they start (tests/faults/precision.py), the exact GELU in place of the tanh one at 8 %, and a part
# whose share of the residual stream is small (the per-layer input's gate kept in fp32) at 1.1 % of
# the layer's output. The limit leaves room for a kernel that reorders a sum in a few elements (a
# 1-ulp tie broken the other way).
DEPARTURE_LIMIT = 0.001
HEALTHY_DEPARTURE = 0.0
# Which way a departure rounds: the departing elements' median of R = |port - fp32| / |bf16 reference -
# fp32|, pooled over the layers where a part departs first. Below OVER_BELOW the port is closer to fp32
# than the model: a later rounding (over-precision, flagged). Above 1 it rounds earlier (a failure);
# in between it is a computation other than the model's at about its precision (a failure too: the
# exact GELU in place of the tanh one reads 0.98). Where from (tests/faults/precision.py, the tiny 12B):
# the later roundings pool at 0.77-0.93, the earlier ones at 1.13-1.42.
OVER_BELOW = 0.95


@dataclass
class PointBits:
    """One capture point of one layer alone: how many of its elements depart, by how many bf16 ulps at
    most, and the departing elements' median R (None: none depart)."""

    name: str
    rows: int
    elements: int
    differing: int
    max_ulps: int
    departing_r: float | None
    lanes: int

    @property
    def fraction(self) -> float:
        return self.differing / self.elements if self.elements else 0.0

    @property
    def departs(self) -> bool:
        return self.fraction > DEPARTURE_LIMIT

    def describe(self, later: bool) -> str:
        way = ("a rounding later than the model's (over-precision)" if later else
               "a rounding earlier than the model's (precision ordering)" if (self.departing_r or 0) > 1 else
               "a computation other than the model's at about its precision")
        return (f"{self.differing} of {self.elements} elements ({self.fraction:.1%}) differ from transformers' bf16 "
                f"layer on the same input (up to {self.max_ulps} bf16 ulps), over the limit {DEPARTURE_LIMIT:.1%}; "
                f"median R on them {self.departing_r:.3f}: {way} (read over the layers where this part departs first)")


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers in the order of the numbers (one step = one ulp)."""
    i = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def point_bits(name: str, port: torch.Tensor, ref16: torch.Tensor, ref32: torch.Tensor) -> PointBits:
    """Compare one point ([rows, lanes] each, fp32 holding the bf16 values): an element departs when
    its value differs at all (a port value bf16 cannot hold, kept in fp32, departs too)."""
    differ = port.float() != ref16.float()
    ulps = (ordered_bits(port) - ordered_bits(ref16)).abs()
    r = None
    if bool(differ.any()):
        err, env = (port.double() - ref32.double()).abs()[differ], (ref16.double() - ref32.double()).abs()[differ]
        keep = env > 0
        r = float((err[keep] / env[keep]).median()) if bool(keep.any()) else float("inf")
    rows = port.shape[0] if port.dim() > 1 else 1
    return PointBits(name=name, rows=rows, elements=port.numel(), differing=int(differ.sum()),
                     max_ulps=int(ulps.max()) if ulps.numel() else 0, departing_r=r,
                     lanes=port.shape[-1] if port.dim() else 1)


@dataclass
class BitwiseStage(StageResult):
    """Every layer with its own KV cache (harness/parity/layer_bits.py), each point judged bit for
    bit (PointBits); an extra stage of check's result. Departures rounding earlier fail; those rounding
    later are over-precision (`over_precision`, flagged by the distribution stage)."""

    points: list[PointBits] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # KV-shared layers: they do not run alone
    notes: list[str] = field(default_factory=list)
    error: dict | None = None  # an exception raised inside the port's layers alone
    stage: str = "bitwise_layers"

    @property
    def ran(self) -> bool:
        return bool(self.points) or self.error is not None

    @property
    def departures(self) -> list[PointBits]:
        return [p for p in self.points if p.departs]

    def starts(self) -> list[tuple[PointBits, bool]]:
        """(point, rounds later) where each departing layer's departure starts (its first departing
        point; its later points carry it), in run order. Which way a part rounds is read over every
        layer where it starts: the median of those points' departing R (below OVER_BELOW: later)."""
        first: dict[int, PointBits] = {}
        for p in self.departures:
            first.setdefault(Point.parse(p.name).layer, p)
        by_part: dict[str, list[float]] = {}
        for p in first.values():
            by_part.setdefault(Point.parse(p.name).part, []).append(p.departing_r)
        later = {part: float(torch.tensor(rs, dtype=torch.double).median()) < OVER_BELOW for part, rs in by_part.items()}
        return [(p, later[Point.parse(p.name).part]) for p in first.values()]

    @property
    def over_precision(self) -> list[OverPrecision]:
        """Departures rounding later as precision.OverPrecision (harness/judge/precision.py flags them)."""
        return [OverPrecision(p.name, "bitwise", p.departing_r, p.rows, p.lanes) for p, later in self.starts() if later]

    def gates(self) -> list[Gate]:
        if self.error is not None:
            return [Gate("error", [dict(self.error, stage=self.stage, point="exception inside the port's layers alone")])]
        return [Gate("bit_exact", self._early())]

    def _early(self) -> list[dict]:
        """The first departure not rounding later, where it starts, with how many layers depart so."""
        early = [p for p, later in self.starts() if not later]
        if not early:
            return []
        p, where = early[0], Point.parse(early[0].name)
        more = f"; {len(early) - 1} more layers depart so" if len(early) > 1 else ""
        return [{"stage": self.stage, "point": p.name, "ratio": p.departing_r,
                 "where": f"layer {where.layer} ({where.part}), alone at TP 1", "detail": p.describe(False) + more}]

    def describe(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        judged = sorted({Point.parse(p.name).layer for p in self.points})
        lines = [f"bit-exact layers (each layer alone at TP 1 against transformers' bf16 layer, limit "
                 f"{DEPARTURE_LIMIT:.1%} of a point's elements; healthy census {HEALTHY_DEPARTURE:.0%}): {verdict}, "
                 f"{len(judged)} layers, {len(self.departures)} of {len(self.points)} points depart"]
        lines += [f"  FAIL {f['point']}: {f.get('detail', f.get('message', ''))}" for f in self.failures()]
        lines += [f"  over-precision {p.name}: {p.describe(True)}" for p, later in self.starts() if later][:3]
        if self.skipped:
            lines.append(f"  not judged: layers {self.skipped} (they read another layer's KV cache: they do not run "
                         "alone)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def payload(self) -> dict:
        return {"departure_limit": DEPARTURE_LIMIT, "healthy_census": HEALTHY_DEPARTURE, "error": self.error,
                "skipped_layers": self.skipped,
                "over_precision": [o.to_json() for o in self.over_precision],
                "points": [{"point": p.name, "elements": p.elements, "differing": p.differing,
                            "max_ulps": p.max_ulps, "departing_r": p.departing_r} for p in self.points]}
