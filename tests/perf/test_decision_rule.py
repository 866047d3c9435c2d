"""The alert's decision rule, tested on itself: both sides of the ratio gate and of alpha, with a
non-default alpha, on every metric, and its false-alarm rate measured with enough trials to see a
doubled rate.

Numbers. At alpha = 0.05 with no real change, each metric alarms in a trial with probability about
alpha (factor 1.0, so the ratio gate cannot hide the test). Over TRIALS = 1000 trials the count is
Binomial(1000, 0.05): mean 50; the test accepts counts inside its 0.1% and 99.9% quantiles
(computed below: 30 and 73). A gate loosened to 2 x alpha gives Binomial(1000, 0.10), mean 100,
which exceeds 73 with probability 0.998 (asserted below as the test's own power); a gate
tightened to alpha / 3 (mean 17) falls under 30 with probability > 0.99. The same holds for
improvements (the mirror test) and for each of the three metrics separately.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
from scipy import stats as scipy_stats

from harness import perf

from tests.perf.test_perf_regression import samples, synthetic_result

ALPHA = 0.05  # not the default 0.01
FACTOR = 1.2  # not the default 1.1
TRIALS = 1000
METRICS = ["prefill_ms", "prefill_ms[16]", "decode_ms_per_token"]


def binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def binom_quantiles(n: int, p: float, tail: float) -> tuple[int, int]:
    """(lo, hi): P(X < lo) < tail and P(X > hi) < tail for X ~ Binomial(n, p)."""
    lo = next(k for k in range(n + 1) if binom_cdf(k, n, p) >= tail)
    hi = next(k for k in range(n + 1) if 1 - binom_cdf(k, n, p) < tail)
    return lo, hi


def three_metric_result(rng: random.Random, scale: float = 1.0, n: int = 20) -> dict:
    result = synthetic_result(samples(rng, 100, 0.05, n, scale), samples(rng, 30, 0.05, n, scale))
    result["prefill_ms_by_bucket"]["16"] = samples(rng, 40, 0.05, n, scale)
    return result


# ---- the rule itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("ratio_side", [-1, 1])
@pytest.mark.parametrize("p_side", [-1, 0, 1])
def test_regression_needs_both_gates(ratio_side, p_side):
    ratio = FACTOR * (1 + 1e-6 * ratio_side)
    p = ALPHA * (1 + 1e-6 * p_side)  # p == alpha is not significant: the test is p < alpha
    verdict, regressed, improved = perf.decide(ratio, p, 1 - p, True, FACTOR, ALPHA)
    assert regressed == (ratio_side > 0 and p_side < 0) and not improved
    assert (verdict == "REGRESSION") == regressed


@pytest.mark.parametrize("ratio_side", [-1, 1])
@pytest.mark.parametrize("p_side", [-1, 0, 1])
def test_improvement_needs_both_gates(ratio_side, p_side):
    ratio = (1 / FACTOR) * (1 + 1e-6 * ratio_side)
    p = ALPHA * (1 + 1e-6 * p_side)
    verdict, regressed, improved = perf.decide(ratio, 1 - p, p, True, FACTOR, ALPHA)
    assert improved == (ratio_side < 0 and p_side < 0) and not regressed
    assert (verdict == "faster") == improved


def test_no_verdict_when_the_sizes_cannot_reach_alpha():
    verdict, regressed, improved = perf.decide(10.0, 1e-9, 1.0, False, FACTOR, ALPHA)
    assert (regressed, improved) == (False, False) and verdict.startswith("too few runs")


def test_each_metric_flips_exactly_at_its_own_ratio_and_p_value():
    """Through compare_results on every metric: with alpha and factor set just either side of that
    metric's own p-value and ratio (computed here with scipy and statistics), only that metric's
    verdict changes."""
    rng = random.Random(11)
    base, cur = three_metric_result(rng), three_metric_result(rng, scale=1.06)
    for metric in METRICS:
        b, c = perf.metric_samples(base)[metric], perf.metric_samples(cur)[metric]
        p = scipy_stats.mannwhitneyu(c, b, alternative="greater", method="asymptotic").pvalue
        ratio = statistics.median(c) / statistics.median(b)
        assert p < 0.2 and ratio > 1.0, "the planted 6% slowdown is visible on every metric"
        for a_side, f_side in [(1, -1), (-1, -1), (1, 1)]:
            alpha, factor = p * (1 + 1e-6 * a_side), ratio * (1 + 1e-6 * f_side)
            comp = perf.compare_results(base, cur, factor=factor, alpha=alpha, intervals=False)
            got = {m.metric: m for m in comp.metrics}[metric]
            assert got.p_value == pytest.approx(p, rel=1e-12) and got.ratio == pytest.approx(ratio, rel=1e-12)
            assert got.regressed == (a_side > 0 and f_side < 0), (metric, a_side, f_side)


# ---- its false-alarm rate -------------------------------------------------------------------------

def test_the_trial_count_can_see_a_doubled_or_a_third_false_alarm_rate():
    lo, hi = binom_quantiles(TRIALS, ALPHA, 1e-3)
    assert (lo, hi) == (30, 73)
    assert 1 - binom_cdf(hi, TRIALS, 2 * ALPHA) > 0.998  # power against a gate at 2 x alpha
    assert binom_cdf(lo - 1, TRIALS, ALPHA / 3) > 0.99  # and against one at alpha / 3


def test_false_alarm_and_false_improvement_rates_are_alpha_on_every_metric():
    lo, hi = binom_quantiles(TRIALS, ALPHA, 1e-3)
    alarms = dict.fromkeys(METRICS, 0)
    improvements = dict.fromkeys(METRICS, 0)
    rng = random.Random(2026)
    for _ in range(TRIALS):
        comp = perf.compare_results(three_metric_result(rng), three_metric_result(rng), factor=1.0,
                                    alpha=ALPHA, intervals=False)
        for m in comp.metrics:
            alarms[m.metric] += m.regressed
            improvements[m.metric] += m.improved
    for metric in METRICS:
        assert lo <= alarms[metric] <= hi, (metric, alarms[metric], (lo, hi))
        assert lo <= improvements[metric] <= hi, (metric, improvements[metric], (lo, hi))
