"""Change points in a metric's history: where the run medians stepped, and which run was first
after the step.

Method: the standardized CUSUM statistic for a shift in mean (E. S. Page, "Continuous inspection
schemes", Biometrika 41, 1954), on the logs of the run medians (a slowdown is a ratio), with a
permutation p-value (J. Antoch and M. Huskova, "Permutation tests in change point analysis",
Statistics & Probability Letters 53, 2001, 37-46), applied by binary segmentation (A. J. Scott and
M. Knott, Biometrics 30, 1974; L. Vostrikova, Soviet Math. Dokl. 24, 1981) to find several. For
T values x_1..x_T with mean m,
    C_t = |(x_1 - m) + ... + (x_t - m)| / sqrt(t (T - t) / T),   C = max_t C_t,
and the change point is the t that attains C (runs 1..t before it, t+1..T after): the split that
best separates two levels in the least-squares sense. Its p-value is the share of PERMUTATIONS
random orders of the same values (fixed seed) whose C is at least as large: exact under "no change"
(the runs are then exchangeable) whatever the noise's distribution. A segment is split only when
p < alpha, so on a history with no change the chance of reporting any change point (the
false-alarm rate) is alpha: later splits are only tried after a first one was found.

Several metrics are tested at once (prefill, decode, TTFT, TPOT, E2E, other buckets), so the
family is controlled, not each metric: Holm's step-down procedure (S. Holm, "A simple sequentially
rejective multiple test procedure", Scandinavian Journal of Statistics 6, 1979) on each metric's
first split, the i-th smallest of m p-values tested at alpha / (m - i + 1) and stopping at the
first that fails; the further splits of a metric that stepped are tested at alpha / m (Bonferroni).
On histories with no change in any metric, the chance of reporting any change point is then at
most alpha whatever the dependence between the metrics (without it, five metrics alarmed about
2.5x as often as alpha).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

PERMUTATIONS = 1999
SEED = 1979
MIN_SEGMENT = 2  # runs on each side of a change point


@dataclass
class ChangePoint:
    metric: str
    index: int  # position (0-based) of the first run after the step in the analysed runs
    run: str  # that run's file name
    commit: str  # that run's git commit: where to look for the cause
    created: str
    before_median: float  # median of the run medians before the step
    after_median: float
    ratio: float
    p_value: float
    direction: str  # "slower" | "faster"

    def to_dict(self) -> dict:
        return asdict(self)


def cusum(values, permutations: int = PERMUTATIONS, seed: int = SEED) -> tuple[int, float, float]:
    """(t, C, p): the split after the first t values, the statistic, its permutation p-value."""
    import numpy as np

    x = np.log(np.asarray(values, dtype=float))
    n = len(x)
    if n < 2 * MIN_SEGMENT:
        return 0, 0.0, 1.0
    t = np.arange(MIN_SEGMENT, n - MIN_SEGMENT + 1)
    weight = np.sqrt(t * (n - t) / n)

    def statistic(rows):
        centred = rows - rows.mean(axis=-1, keepdims=True)
        return np.abs(np.cumsum(centred, axis=-1)[..., t - 1]) / weight

    observed = statistic(x)
    best = int(np.argmax(observed))
    rng = np.random.default_rng(seed)
    shuffled = rng.permuted(np.tile(x, (permutations, 1)), axis=1)
    exceed = np.count_nonzero(statistic(shuffled).max(axis=1) >= observed[best] * (1 - 1e-12))
    return int(t[best]), float(observed[best]), float((1 + exceed) / (permutations + 1))


def segments(values, alpha: float, offset: int = 0, first_alpha: float | None = None) -> list[tuple[int, float]]:
    """Binary segmentation: (index of the first value after each change, p-value), sorted. The
    first split is tested at `first_alpha` (default alpha), the later ones at alpha."""
    if len(values) < 2 * MIN_SEGMENT:
        return []
    split, _, p = cusum(values)
    if p >= (alpha if first_alpha is None else first_alpha):
        return []
    return sorted(segments(values[:split], alpha, offset) + [(offset + split, p)]
                  + segments(values[split:], alpha, offset + split))


def runs_needed(alpha: float) -> int:
    """The fewest runs in which a perfect step (every run after slower than every run before) can
    reach p < alpha: the permutation p-value of the best split is about 2 / C(T, T/2)."""
    for n in range(2 * MIN_SEGMENT, 200):
        if 2 / math.comb(n, n // 2) + 1 / (PERMUTATIONS + 1) < alpha:
            return n
    return 200


def testable(runs: list[dict]) -> bool:
    """Enough runs for a split, and positive medians (a zero median, from an empty or broken run,
    has no log)."""
    medians = [r["median"] for r in runs]
    return len(medians) >= 2 * MIN_SEGMENT and min(medians) > 0


def find_change_points(metric: str, runs: list[dict], alpha: float,
                       first_alpha: float | None = None) -> list[ChangePoint]:
    """`runs`: dicts with name, commit, created and median, oldest first. One metric alone: its
    false-alarm rate is alpha (`first_alpha`, when given, is the first split's level)."""
    import statistics

    medians = [r["median"] for r in runs]
    if not testable(runs):
        return []
    found = []
    steps = segments(medians, alpha, first_alpha=first_alpha)
    bounds = [0] + [i for i, _ in steps] + [len(runs)]
    for (i, p), lo, hi in zip(steps, bounds[:-2], bounds[2:]):
        before = statistics.median(medians[lo:i])
        after = statistics.median(medians[i:hi])
        run = runs[i]
        found.append(ChangePoint(metric, i, run["name"], run["commit"], run["created"], before, after,
                                 after / before if before > 0 else math.inf, p,
                                 "slower" if after > before else "faster"))
    return found


def find_family(trend: dict[str, list[dict]], alpha: float) -> tuple[list[ChangePoint], int]:
    """Change points of every metric of `trend` (metric -> runs), family-wise at `alpha` by Holm's
    step-down over the metrics' first splits (module docstring); also the number of metrics tested."""
    tested = {metric: runs for metric, runs in trend.items() if testable(runs)}
    m = len(tested)
    first_p = {metric: cusum([r["median"] for r in runs])[2] for metric, runs in tested.items()}
    found = []
    for i, metric in enumerate(sorted(tested, key=lambda k: (first_p[k], k))):
        level = alpha / (m - i)
        if first_p[metric] >= level:
            break  # Holm: every larger p-value is retained too
        found += find_change_points(metric, tested[metric], alpha / m, first_alpha=level)
    order = list(trend)
    return sorted(found, key=lambda cp: (order.index(cp.metric), cp.index)), m
