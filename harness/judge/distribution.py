"""The distributional gate: R = |port - fp32| / |bf16 reference - fp32| read over every
capture point and teacher-forced position of the bf16 stage, not at its worst point alone.

compare.compare_point leaves R at every position of a point (PointResult.position_r). Here they are
pooled per point kind (the residual points, the KV cache's keys and values, the final norm, the
logits, the family's parts), once along the port's own run (cumulative: R inherits upstream error)
and once for each layer alone on the reference's input (local: the layer's own error). Per kind the
median and the 95th percentile of R are reported and gated; a healthy port's R sits at 1 (two bf16
computations of one function err alike), a rounding to bf16 earlier or later than the reference
moves the median off 1 at every position, where the per-point limit (4x, compare.ENVELOPE_FACTOR)
sees nothing. Below 1 is over-precision (harness/judge/precision.py). The numbers and where they
come from are in docs/judging.md#the-distributional-gate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from harness.base.points import Point
from harness.judge.precision import find_over_precision, flagged_over_precision
from harness.judge.ratios import MIN_POSITIONS, POINT_MIN_POSITIONS, finite_r
from harness.judge.stage_result import Gate, Stage, StageResult

# The gate, per scope (LIMITS: median and 95th percentile of R over a kind's positions, and over all
# kinds together). Where from: the healthy census (tests/census, 52 members with local verdicts;
# `python -m tests.census.distribution` prints it, docs/judging.md#the-distributional-gate carries it).
# - local (each layer alone on the reference's input: R inherits nothing): the census's largest
#   median of a kind is 1.032 (HEALTHY) and of a p95 1.243; RMSNorm without its fp32 upcast reads
#   1.10-1.12 and Llama's norm order (the weight after the cast) 1.06-1.08 (tests/faults/precision.py).
# - cumulative (the port's own run): R compounds with depth and teacher-forced decode rows are few and
#   alike; a healthy final norm reached a median of 1.22 and the gated per-layer input a p95 of 1.83,
#   so the cumulative gate is AWS's coarse table: a median above 1.5 is "precision ordering or a
#   missing multiplier", a p95 above 3 "likely a bug". RMSNorm without its upcast reads 1.13-1.19.
LIMITS = {"local": (1.05, 1.6), "cumulative": (1.5, 3.0)}
HEALTHY = {"local": (1.032, 1.243), "cumulative": (1.221, 1.828)}
# The MoE router's chosen-expert weights (dense over the experts, zero where not chosen) have no p95
# of R worth gating: the healthy census saw 6.3 (a few positions' weights against near-zero
# envelopes); their median (1.00) is gated.
NO_P95 = ("expert_weights",)


def point_kind(name: str) -> str:
    """attn_residual, mlp_residual, output, per_layer_input, ... (layer parts), kv.k / kv.v, or an
    edge kind (embeddings, final_norm, logits); prefill and decode pool (both are positions)."""
    point = Point.parse(name)
    if point.kind == "layer":
        return point.part
    return f"kv.{point.part}" if point.kind == "kv" else point.kind


@dataclass
class KindStats:
    """The distribution of R over one kind's positions in one scope."""

    kind: str
    scope: str  # "cumulative" (the port's run) or "local" (each layer alone)
    positions: int  # R values pooled (a position at every point of the kind)
    rows: int  # distinct positions: the most rows of one point (the same row at every layer is one draw)
    median: float
    p95: float

    @classmethod
    def of(cls, kind: str, scope: str, points) -> "KindStats | None":
        r = finite_r(points)
        if r.numel() == 0:
            return None
        rows = max(finite_r([p]).numel() for p in points)
        return cls(kind=kind, scope=scope, positions=int(r.numel()), rows=rows, median=float(r.median()),
                   p95=float(torch.quantile(r, 0.95)))

    @property
    def gated(self) -> bool:
        return self.rows >= MIN_POSITIONS

    def breaches(self) -> list[tuple[str, float, float]]:
        """(statistic, value, limit) over the scope's gate (LIMITS)."""
        if not self.gated:
            return []
        median, p95 = LIMITS[self.scope]
        judged = (("median", self.median, median),) + ((("p95", self.p95, p95),) if self.kind not in NO_P95 else ())
        return [(s, v, lim) for s, v, lim in judged if v > lim]


def where(points, statistic: str, limit: float) -> str:
    """Where a breach starts: the first point in run order whose own median (or p95) is over `limit`
    (the healthy census's largest: a point's own statistic is noisier than its kind's), else the
    kind's worst."""
    def stat(p):
        r = finite_r([p])
        if r.numel() < POINT_MIN_POSITIONS:
            return None
        return float(r.median()) if statistic == "median" else float(torch.quantile(r, 0.95))

    judged = [(p, stat(p)) for p in points]
    judged = [(p, s) for p, s in judged if s is not None]
    if not judged:
        return points[0].name
    over = next(((p, s) for p, s in judged if s > limit), None)
    p, s = over or max(judged, key=lambda ps: ps[1])
    return f"{p.name} ({statistic} {s:.3f})"


def by_kind(points, kind_of) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in points:
        out.setdefault(kind_of(p.name), []).append(p)
    return out


@dataclass(eq=False)
class Distribution(StageResult):
    """R's distribution per kind and scope, the gate's breaches, and the over-precision found
    (harness/judge/precision.py); a stage of check's result (harness.judge.stage_result)."""

    kinds: list[KindStats] = field(default_factory=list)
    overall: list[KindStats] = field(default_factory=list)
    breaches: list[dict] = field(default_factory=list)
    over_precision: list = field(default_factory=list)  # precision.OverPrecision, run order
    strict: bool = False  # over-precision fails (--strict-precision) instead of warning
    notes: list[str] = field(default_factory=list)
    stage: str = "distribution"
    ran: bool = True
    served: object = field(default=None, repr=False)  # the served stage this reads (its over-precision)
    bitwise: object = field(default=None, repr=False)  # the bit-exact layers stage this reads (likewise)
    # The check's fp32 and bf16 stages this reads: a gate beside the point limits, so where a stage
    # already fails at its points the distribution reports, not fails again.
    parity: tuple = field(default=(), repr=False, compare=False)

    @property
    def superseded(self) -> bool:
        return any(not s.passed for s in self.parity)

    @property
    def flagged(self) -> list:
        """The check's over-precision (R's and the bit-exact layers', run order), then the served build's
        (the stages this read)."""
        return flagged_over_precision(self.over_precision, [s for s in (self.bitwise, self.served) if s is not None])

    def gates(self) -> list[Gate]:
        if self.superseded:
            return [Gate("distribution")]
        out = [dict(b, stage=self.stage) for b in self.breaches]
        if self.strict:
            out += [dict(o.failure(), stage=self.stage) for o in self.flagged[:1]]
        return [Gate("distribution", out)]

    def describe(self) -> str:
        gate = "; ".join(f"{scope} median <= {m:g}, p95 <= {q:g} (healthy census {HEALTHY[scope][0]:g}, "
                         f"{HEALTHY[scope][1]:g})" for scope, (m, q) in LIMITS.items())
        lines = [f"distribution of R = |port - fp32| / |bf16 ref - fp32| (bf16 stage), per kind and overall over "
                 f">= {MIN_POSITIONS} positions: {gate}"]
        rows = {}
        for s in self.overall + self.kinds:
            rows.setdefault(s.kind, {})[s.scope] = s
        for kind, scopes in rows.items():
            cells = [f"{scope} median {s.median:.3f} p95 {s.p95:.3f} ({s.rows} positions"
                     f"{'' if s.gated else ', too few to gate'})" for scope, s in scopes.items()]
            lines.append(f"  {kind:16s} " + "; ".join(cells))
        lines += [f"  FAIL {b['point']}, from {b['where']}: {b['detail']}" for b in self.breaches]
        for o in self.flagged[:3]:
            lines.append(f"  {'FAIL' if self.strict else 'WARNING'} over-precision: {o.describe()}")
        if len(self.flagged) > 3:
            lines.append(f"  ... over-precision at {len(self.flagged) - 3} more points (the JSON's "
                         "extra_stages.distribution)")
        lines += [f"  note: {n}" for n in self.notes]
        verdict = "PASS" if self.passed else "FAIL"
        if self.superseded and (self.breaches or self.flagged):
            verdict = "not counted (a stage already fails at its points)"
        return "\n".join(lines[:1]) + f": {verdict}\n" + "\n".join(lines[1:])

    def payload(self) -> dict:
        def clean(d):
            return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in d.items()}

        return {"strict_precision": self.strict, "superseded": self.superseded,
                "breaches": self.breaches,
                "limits": {scope: {"median": m, "p95": q} for scope, (m, q) in LIMITS.items()},
                "min_positions": MIN_POSITIONS,
                "healthy_census": {scope: {"median": m, "p95": q} for scope, (m, q) in HEALTHY.items()},
                "overall": [clean(asdict(s)) for s in self.overall], "kinds": [clean(asdict(s)) for s in self.kinds],
                "over_precision": [o.to_json() for o in self.flagged]}


def scope_stats(points, scope: str, kind_of=None) -> tuple[list[KindStats], list[dict]]:
    """Per kind (`kind_of`, default point_kind): its stats and the gate's breaches, each naming
    where the breach starts."""
    stats, breaches = [], []
    for kind, members in by_kind(points, kind_of or point_kind).items():
        s = KindStats.of(kind, scope, members)
        if s is None:
            continue
        stats.append(s)
        for statistic, value, limit in s.breaches():
            breaches.append({"point": f"R {statistic} of {kind} ({scope})", "ratio": value,
                             "where": where(members, statistic, HEALTHY[scope][statistic == "p95"]),
                             "detail": f"{statistic} of R over {s.rows} positions ({s.positions} values) is "
                                       f"{value:.3f}, over the gate {limit:g} (precision ordering or a missing "
                                       "multiplier)"})
    return stats, breaches


def judge_distribution(result, strict: bool = False, served=None, bitwise=None, fp32=None) -> Distribution:
    """The bf16 stage of a check (harness.judge.results.ParityStage, its local verdicts when they
    ran) read as distributions of R, gated, with its over-precision (precision.find_over_precision)
    and the bit-exact layers' and the `served` stage's; `strict` (--strict-precision): over-precision fails
    instead of warning. Where the bf16 or the `fp32` stage already fails, it reports, not fails again."""
    cumulative = [p for p in result.all_points() if getattr(p, "position_r", None) is not None]
    local = [p for v in (result.local_verdicts or []) for p in v.local]
    kinds, breaches = scope_stats(cumulative, "cumulative")
    local_kinds, local_breaches = scope_stats(local, "local")
    overall, overall_breaches = [], []
    for scope, points in (("cumulative", cumulative), ("local", local)):
        stats, found = scope_stats(points, scope, lambda name: "all")
        overall, overall_breaches = overall + stats, overall_breaches + found
    alone = ("no layer of this model runs alone (each reads a per-layer input or another layer's KV cache)"
             if result.local == [] else "no local (layer-alone) verdicts ran")
    notes = [] if local else [f"{alone}: the cumulative distribution alone is gated and the layers' "
                              "over-precision is not judged" + ("" if result.local == [] else " (run bisect, capture mode)")]
    return Distribution(kinds=kinds + local_kinds, overall=overall, breaches=breaches + local_breaches + overall_breaches,
                        over_precision=find_over_precision(cumulative, local), strict=strict, notes=notes,
                        parity=tuple(s for s in (fp32, result) if s is not None), served=served, bitwise=bitwise)


def distribution_stage(strict: bool = False) -> Stage:
    """The distribution as a stage of the parity run: it reads the fp32 and bf16 stages' results and the
    served and bit-exact stages (after them); none where the bf16 stage raised (nothing observed)."""
    def run(fp32=None, bf16=None, served=None, bitwise_layers=None):
        return None if bf16.port_error else judge_distribution(bf16, strict, served, bitwise_layers, fp32)
    return Stage("distribution", run, reads=(), after=("fp32", "bf16", "served", "bitwise_layers"))
