"""The census read bit for bit: every healthy member's layers that run alone, the port's at TP 1 against
transformers' bf16 layer on the reference's input (harness/parity/layer_bits.py), the share of each
point's elements that differ, beside the bit-exact stage's limit (harness/judge/bitwise.py
DEPARTURE_LIMIT). The stage builds its own TP 1 port, so a member's TP, buckets and cache change nothing:
each checkpoint and prompt set is measured once. `python -m tests.census.bitwise [case-id substrings]`
prints the table docs/judging.md carries (the real-width member is left out here: ~14 GiB; the slow
lane's census runs the stage on it inside its check)."""

from __future__ import annotations

import sys

from harness.judge.bitwise import DEPARTURE_LIMIT


class _NoEngine:
    """What the stage reads of an engine: its settings (a bf16 port; it builds its own TP 1 port)."""

    from harness.base.settings import RunSettings

    settings = RunSettings(tp=2)


def measure(case) -> tuple[int, int, float, str]:
    """(points judged, points with any element differing, the largest share differing, where)."""
    from harness.parity.layer_bits import bitwise_layers
    from harness.parity.local import intra_op_threads_for
    from tests.census.ports import checkpoint, references

    ckpt = checkpoint(case.shape)
    refs = references(case.shape, case.run.prompts, case.run.new_tokens)
    with intra_op_threads_for(ckpt.spec):
        stage = bitwise_layers(ckpt, _NoEngine(), refs["float32"])
    worst = max(stage.points, key=lambda p: p.fraction, default=None)
    return (len(stage.points), sum(p.differing > 0 for p in stage.points), worst.fraction if worst else 0.0,
            worst.name if worst else "-")


def main() -> int:
    from tests.census.cases import CASES, REAL_WIDTH_CASE

    only, seen, worst = set(sys.argv[1:]), set(), (0.0, "-")
    print("| member | points judged | points with a differing element | largest share differing |\n|---|---|---|---|")
    for case in CASES:
        key = (case.shape, case.run.prompts)
        if case is REAL_WIDTH_CASE or key in seen or (only and not any(o in case.id for o in only)):
            continue
        seen.add(key)
        points, differing, fraction, where = measure(case)
        worst = max(worst, (fraction, case.id))
        print(f"| {case.id} | {points} | {differing} | {fraction:.4%} ({where}) |", flush=True)
    print(f"healthy worst {worst[0]:.4%} ({worst[1]}); limit {DEPARTURE_LIMIT:.1%}")
    return 0 if worst[0] <= DEPARTURE_LIMIT else 1


if __name__ == "__main__":
    raise SystemExit(main())
