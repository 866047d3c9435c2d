"""The census read as distributions of R (issue 38): per point kind and scope (cumulative, local), the
largest median and 95th percentile of R any healthy port shows, and the lowest median of a point
(over-precision's healthy floor), beside the gate (harness/judge/distribution.py,
harness/judge/precision.py) and the margin between them. `python -m tests.census.distribution
[case-id substrings]` runs the census with local verdicts and prints the table docs/judging.md
carries."""

from __future__ import annotations

import sys

from harness.judge.distribution import LIMITS, NO_P95
from harness.judge.ratios import MIN_POSITIONS, finite_r
from harness.judge.precision import OVER_PRECISION_LIMIT


def extremes(result) -> dict:
    """{(kind, scope, statistic): value} of one check's distribution stage: the kinds' medians and
    p95s (gated ones), and the lowest median of a point with enough positions."""
    dist = next(s for s in result.extra_stages if s.stage == "distribution")
    out = {}
    for s in dist.kinds + dist.overall:
        if s.gated:
            out[(s.kind, s.scope, "median")] = s.median
            out[(s.kind, s.scope, "p95")] = s.p95
    from harness.judge.precision import judged_points

    bf16 = result.bf16
    points = judged_points([p for p in bf16.all_points() if getattr(p, "position_r", None) is not None],
                           [p for v in bf16.local_verdicts or [] for p in v.local])
    medians = [float(finite_r([p]).median()) for _, p in points if finite_r([p]).numel() >= MIN_POSITIONS]
    if medians:
        out[("point", "any", "lowest median")] = min(medians)
    return out


def merge(table: dict, row: dict, case: str) -> None:
    for key, value in row.items():
        low = key[2] == "lowest median"
        if key not in table or (value < table[key][0] if low else value > table[key][0]):
            table[key] = (value, case)


def render(table: dict) -> str:
    lines = ["| kind | scope | statistic | healthy extreme | gate | margin | where |", "|---|---|---|---|---|---|---|"]
    for (kind, scope, stat), (value, case) in sorted(table.items()):
        if stat == "p95" and kind in NO_P95:
            lines.append(f"| {kind} | {scope} | {stat} | {value:.3f} | not gated | - | {case} |")
            continue
        gate = OVER_PRECISION_LIMIT if stat == "lowest median" else LIMITS[scope][stat == "p95"]
        margin = value / gate if stat == "lowest median" else gate / value
        lines.append(f"| {kind} | {scope} | {stat} | {value:.3f} | {gate:g} | {margin:.2f}x | {case} |")
    return "\n".join(lines)


def main() -> int:
    from tests.census.cases import CASES
    from tests.census.ports import run_check

    only = set(sys.argv[1:])
    table, failed = {}, []
    for case in CASES:
        if only and not any(o in case.id for o in only):
            continue
        result = run_check(case.shape, case.run, local=True)
        merge(table, extremes(result), case.id)
        dist = next(s for s in result.extra_stages if s.stage == "distribution")
        if not dist.passed or dist.flagged or not result.passed:
            failed.append(case.id)
        worst = max((s for s in dist.kinds if s.gated), key=lambda s: s.median, default=None)
        print(f"{case.id}: {'PASS' if case.id not in failed else 'FAIL'} passed={result.passed} "
              f"worst median {worst.kind if worst else '-'} {worst.median if worst else 0:.3f} "
              f"over-precision {[o.point for o in dist.flagged][:2]}", flush=True)
    print(render(table))
    print(f"{len(failed)} distribution failures or over-precision: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
