"""The upstream census (issue 45): transformers' own Gemma-4 tester configurations
(tests/census/upstream.py cites each), built with the classes' own initialisation at several seeds,
TP 1 and TP 2, pass `check` on the healthy port: both stages, every departing token and router
choice decided on the port's own path. One short member runs in the default lane, the rest slow."""

from __future__ import annotations

import pytest

from tests.census.upstream import UPSTREAM_CASES, run_check


@pytest.mark.parametrize("member", [pytest.param(m, id=m.id, marks=() if m.fast else pytest.mark.slow)
                                    for m in UPSTREAM_CASES])
def test_upstream_tester_config_passes_check(member):
    result = run_check(member.case, member.run)
    assert result.fp32 is not None and result.fp32.passed, result.fp32.failures()[:3]
    assert result.passed, result.failures()[:3]
    if result.bf16.routing is not None:  # MoE testers: every router choice decided on the port's own path
        print(result.bf16.routing.describe())
        assert result.bf16.routing.own_path and result.bf16.routing.passed
    print(result.bf16.calibration.describe())


def test_upstream_census_covers_both_model_types_seeds_and_tp():
    ids = {m.id for m in UPSTREAM_CASES}
    assert {m.case.model_type for m in UPSTREAM_CASES} == {"gemma4_text", "gemma4_unified", "gemma4", "trained"}
    assert any("vision2text" in i for i in ids) and any("audio2text" in i for i in ids)
    assert {m.run.tp for m in UPSTREAM_CASES} == {1, 2}
    assert len({m.case.seed for m in UPSTREAM_CASES}) >= 3
    assert any("k-eq-v" in i for i in ids) and any("window2" in i for i in ids)
    assert any(m.fast for m in UPSTREAM_CASES)
