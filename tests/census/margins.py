"""The census's margins: per judged quantity, how close a healthy port came to its limit (its
largest ratio as a fraction of the limit it must stay within; 1.0 is a failure). Issue 26: a
judged quantity whose healthy maximum passes half its limit is a defect to fix, not a limit to
raise. `python -m tests.census.margins` runs the whole census and prints the table."""

from __future__ import annotations

from harness.judge.compare import ENVELOPE_FACTOR, FP32_FACTOR


def _share(choice) -> float:
    """A choice's margin over its threshold; 0 where it is the same choice on the port's own path
    (margin and threshold 0: nothing departed)."""
    return choice.margin / choice.threshold if choice.threshold > 0 else 0.0


def _points(stage, factor: float, label: str) -> dict:
    points = stage.all_points()
    if not points:
        return {}
    return {f"{label} points, whole tensor": max(p.ratio for p in points) / factor,
            f"{label} points, worst position": max(p.position_ratio for p in points) / factor}


def _tokens(stage, label: str) -> dict:
    ties = [m for p in stage.prompts for m in p.prefill.mismatches + p.decode.mismatches
            + ([p.departure] if p.departure is not None else []) if m.kind == "near_tie"]
    return {f"{label} token near ties (margin / band)": max((_share(m) for m in ties), default=0.0)}


def margins(result) -> dict:
    """{quantity: largest healthy ratio / its limit} of one check (both stages)."""
    out = {}
    for stage, factor in ((result.bf16, ENVELOPE_FACTOR), (result.fp32, FP32_FACTOR)):
        if stage is None:
            continue
        out.update(_points(stage, factor, stage.stage))
        out.update(_tokens(stage, stage.stage))
        for prob in stage.probabilities:
            out[f"{stage.stage} host {prob.name}"] = prob.ratio
    bf16 = result.bf16
    if bf16.routing is not None:
        flips = [f for f in bf16.routing.flips if f.kind == "near_tie"]
        out["bf16 routing near ties (margin / band)"] = max((_share(f) for f in flips), default=0.0)
    if bf16.local:
        out["bf16 local layers"] = max(v.ratio for v in bf16.local) / ENVELOPE_FACTOR
    return out


def merge(table: dict, row: dict, case: str) -> None:
    """table[quantity] = (largest margin, the case where it was seen)."""
    for name, value in row.items():
        if name not in table or value > table[name][0]:
            table[name] = (value, case)


def render(table: dict) -> str:
    lines = ["| judged quantity | largest healthy margin | where |", "|---|---|---|"]
    lines += [f"| {name} | {value:.2f} | {case} |" for name, (value, case) in sorted(table.items())]
    return "\n".join(lines)


def main() -> int:
    import sys

    from tests.census.cases import CASES
    from tests.census.ports import run_check

    table, failed = {}, []
    only = set(sys.argv[1:])
    for case in CASES:
        if only and not any(o in case.id for o in only):
            continue
        result = run_check(case.shape, case.run)
        row = margins(result)
        merge(table, row, case.id)
        if not (result.passed and (result.fp32 is None or result.fp32.passed)):
            failed.append(case.id)
        worst = max(row.items(), key=lambda kv: kv[1])
        print(f"{case.id}: {'PASS' if case.id not in failed else 'FAIL'} worst {worst[0]} {worst[1]:.2f}", flush=True)
    print(render(table))
    print(f"{len(failed)} failures: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
