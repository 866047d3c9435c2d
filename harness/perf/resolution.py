"""What a perf comparison can see: the smallest change of a metric's median its samples can detect at
the chosen alpha and power, the runs a side that would resolve a stated change, and whether the two
runs' machines measured the same rates (a busy machine's runs are not comparable with an idle one's).

The detectable change is the normal approximation for a difference of two medians: the median of n
samples with robust spread s (1.4826 x MAD) has standard error about 1.2533 s / sqrt(n), so the
smallest difference a one-sided test at alpha detects with probability `power` is
(z(1 - alpha) + z(power)) x sqrt(se_b^2 + se_c^2), reported relative to the baseline median. The
Mann-Whitney test the verdict uses is at least as efficient as this for heavy-tailed timings.
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist

DEFAULT_POWER = 0.8
STATED_CHANGE = 0.10  # the change `--runs` advice and `bench --runs auto` aim to resolve
MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)  # se(median) / se(mean) for a normal sample
MAX_RUNS = 100_000


def _robust_sd(samples) -> float:
    med = statistics.median(samples)
    return 1.4826 * statistics.median(abs(x - med) for x in samples)


def _z(alpha: float, power: float) -> float:
    return NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(power)


def detectable_change(baseline, current, alpha: float, power: float = DEFAULT_POWER) -> float | None:
    """Smallest relative change of the median these samples detect (None: too few to say)."""
    if len(baseline) < 2 or len(current) < 2:
        return None
    base = statistics.median(baseline)
    if base <= 0:
        return None
    se = MEDIAN_EFFICIENCY * math.hypot(_robust_sd(baseline) / math.sqrt(len(baseline)),
                                        _robust_sd(current) / math.sqrt(len(current)))
    return _z(alpha, power) * se / base


def runs_for(baseline, current, alpha: float, change: float = STATED_CHANGE, power: float = DEFAULT_POWER) -> int:
    """Runs a side (equal sides) for `change` to be detectable, from these samples' spreads."""
    base = statistics.median(baseline)
    spread = math.hypot(_robust_sd(baseline), _robust_sd(current))
    if base <= 0 or spread == 0:
        return 2
    n = (_z(alpha, power) * MEDIAN_EFFICIENCY * spread / (change * base)) ** 2
    return min(max(2, math.ceil(n)), MAX_RUNS)


def resolution_notes(baseline_samples: dict, current_samples: dict, alpha: float,
                     power: float = DEFAULT_POWER) -> list[str]:
    out = []
    for metric in current_samples:
        base, cur = baseline_samples.get(metric) or [], current_samples.get(metric) or []
        change = detectable_change(base, cur, alpha, power)
        if change is None:
            continue
        line = (f"resolution: {metric} detects a change of {change:.1%} or more at alpha {alpha:g}, power "
                f"{power:g} ({len(base)} vs {len(cur)} runs)")
        if change > STATED_CHANGE:
            line += f"; about --runs {runs_for(base, cur, alpha)} a side would resolve {STATED_CHANGE:.0%}"
        out.append(line)
    return out


def machine_rate_notes(baseline: dict, current: dict) -> list[str]:
    """A note when the two runs' measured machine rates differ beyond their spreads (more than
    perf/environment.py's RATE_BOUND apart makes the runs not comparable: the verdict says so)."""
    from harness.perf.environment import RATE_BOUND, rate_differences

    return [f"the two runs' machines measured different {what} (baseline median {a:.3g}, current {b:.3g}: "
            f"{max(a, b) / min(a, b):.2f}x, beyond both spreads; "
            + (f"over the {RATE_BOUND:.0%} the comparison allows: not comparable)" if beyond
               else f"within the {RATE_BOUND:.0%} the comparison allows)")
            for what, a, b, beyond in rate_differences(baseline, current)]
