"""The healthy-port census, the judge's acceptance test (issue 26): `check` on every case of
tests/census/cases.py (shapes, weights, family members, prompt sets, TP degrees, caches) must pass
both stages. Each case prints its margins (largest healthy ratio / its limit, per judged quantity);
`python -m tests.census.margins` prints the table docs/design.md carries. The fast subset runs in the
default lane, the rest in the slow lane."""

from __future__ import annotations

import pytest

from tests.census.cases import CASES
from tests.census.margins import margins
from tests.census.ports import run_check


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=() if c.fast else pytest.mark.slow) for c in CASES])
def test_healthy_port_passes_check(case):
    result = run_check(case.shape, case.run)
    assert (result.fp32 is not None and result.fp32.passed) or not case.run.fp32_stage, result.fp32.failures()[:3]
    assert result.passed, result.failures()[:3]
    dist = next(s for s in result.extra_stages if s.stage == "distribution")  # issue 38: 0 false alarms
    print(dist.describe())
    assert dist.passed and not dist.flagged, dist.describe()
    row = margins(result)
    print(case.id, {k: round(v, 2) for k, v in row.items()})
    assert all(v < 1.0 for v in row.values()), row


def test_census_is_large_enough():
    """At least 40 healthy ports; every family variant; 1-token, 0/1/20 new tokens, TP 1/2/4, ring, chunked."""
    assert len(CASES) >= 40
    variants = {c.shape.variant for c in CASES}
    assert {"31b", "e2b", "e4b", "26b-a4b"} <= variants
    runs = [c.run for c in CASES]
    assert {r.new_tokens for r in runs} >= {0, 1, 20} and {r.tp for r in runs} >= {1, 2, 4}
    assert any(len(r.prompts) == 1 and len(r.prompts[0]) == 1 for r in runs)
    assert any(r.sliding_cache == "ring" for r in runs) and any(max(map(len, r.prompts)) > max(r.buckets) for r in runs)


@pytest.mark.slow  # every member's checkpoint and prompts once (~60 CPU-s); default-lane siblings:
# tests/unit/test_bitwise.py (the tiny 12B bit-exact alone, and two faults departing)
def test_every_member_is_bit_exact_layer_by_layer():
    """The bit-exact layer stage's calibration (issue 38): no element of any point of any healthy
    member's layers alone at TP 1 differs from transformers' bf16 layer (`python -m tests.census.bitwise`
    prints the table; the real-width member runs the stage inside its own check above)."""
    from tests.census.bitwise import measure
    from tests.census.cases import REAL_WIDTH_CASE

    seen, judged = set(), 0
    for case in CASES:
        if case is REAL_WIDTH_CASE or (case.shape, case.run.prompts) in seen:
            continue
        seen.add((case.shape, case.run.prompts))
        points, differing, fraction, where = measure(case)
        assert differing == 0, (case.id, differing, fraction, where)
        judged += points
    assert len(seen) > 40 and judged > 1000
