"""Change points in a metric's history: where the run medians stepped, and which run was first
after the step.

Method: Pettitt's rank test for a single change point (A. N. Pettitt, "A non-parametric approach
to the change-point problem", Applied Statistics 28(2), 1979, 126-135), applied by binary
segmentation (A. J. Scott and M. Knott, Biometrics 30, 1974; L. Vostrikova, Soviet Math. Dokl. 24,
1981) to find several. With ranks r_1..r_T of the T run medians,
    U_t = 2 * (r_1 + ... + r_t) - t * (T + 1),   K = max_t |U_t|,
and the change point is the t that attains K (runs 1..t before it, t+1..T after). The p-value of K
is a permutation p-value (Monte Carlo, fixed seed) rather than Pettitt's asymptotic formula, which
is conservative for the 10-50 runs a history holds. A segment is split only when p < alpha, so on
a history with no change the chance of reporting any change point (the false-alarm rate) is at
most alpha: later splits are only tried after a first one was found. Rank based: one wild run
moves K by at most one rank's worth.
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


def _ranks(values):
    from scipy.stats import rankdata

    return rankdata(values)


def pettitt(values, permutations: int = PERMUTATIONS, seed: int = SEED) -> tuple[int, float, float]:
    """(t, K, p): the split after the first t values, the statistic, its permutation p-value."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    n = len(values)
    if n < 2 * MIN_SEGMENT:
        return 0, 0.0, 1.0
    ranks = _ranks(values)
    t = np.arange(1, n)
    u = 2 * np.cumsum(ranks)[:-1] - t * (n + 1)
    allowed = (t >= MIN_SEGMENT) & (t <= n - MIN_SEGMENT)
    k_obs = np.abs(u[allowed]).max()
    split = int(t[allowed][np.argmax(np.abs(u[allowed]))])
    rng = np.random.default_rng(seed)
    shuffled = rng.permuted(np.tile(ranks, (permutations, 1)), axis=1)
    u_perm = 2 * np.cumsum(shuffled, axis=1)[:, :-1] - t * (n + 1)
    k_perm = np.abs(u_perm[:, allowed]).max(axis=1)
    p = (1 + np.count_nonzero(k_perm >= k_obs - 1e-9)) / (permutations + 1)
    return split, float(k_obs), float(p)


def segments(values, alpha: float, offset: int = 0) -> list[tuple[int, float]]:
    """Binary segmentation: (index of the first value after each change, p-value), sorted."""
    if len(values) < 2 * MIN_SEGMENT:
        return []
    split, _, p = pettitt(values)
    if p >= alpha:
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


def find_change_points(metric: str, runs: list[dict], alpha: float) -> list[ChangePoint]:
    """`runs`: dicts with name, commit, created and median, oldest first."""
    import statistics

    medians = [r["median"] for r in runs]
    found = []
    steps = segments(medians, alpha)
    bounds = [0] + [i for i, _ in steps] + [len(runs)]
    for (i, p), lo, hi in zip(steps, bounds[:-2], bounds[2:]):
        before = statistics.median(medians[lo:i])
        after = statistics.median(medians[i:hi])
        run = runs[i]
        found.append(ChangePoint(metric, i, run["name"], run["commit"], run["created"], before, after,
                                 after / before if before > 0 else math.inf, p,
                                 "slower" if after > before else "faster"))
    return found
