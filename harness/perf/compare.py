"""Budgets, comparisons of two runs, and the verdict per metric.

Regression rule. A metric regresses only when BOTH
  * its median got slower by more than `factor` (default 1.1, a 10% slowdown), and
  * a one-sided Mann-Whitney U test says the current samples tend to be larger than the
    baseline's (p < alpha, default 0.01).
An improvement is the mirror image (median ratio below 1/factor and the other one-sided test
significant). The ratio alone alarms on noisy runs; the test alone alarms on real but negligible
1% changes. When the sample sizes cannot reach p < alpha even if every run moved, no verdict is
given and the number of runs needed is said instead. Every metric also carries a bootstrap
confidence interval of its ratio of medians, at level 1 - 2 * alpha (the two-sided interval whose
bounds match the one-sided tests' level). Budgets are absolute ceilings on the current median,
checked separately from the baseline.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from harness.base.errors import HarnessInputError
from harness.perf import outputs, stats
from harness.perf.batch import pin_batch_outputs
from harness.perf.environment import judge_environment
from harness.perf.length import pin_length_outputs
from harness.perf.results import CONFIGURATION_FIELDS, mismatches
from harness.perf.samples import budget_samples, metric_samples

# Absolute ceilings on the median, in ms, for the real 12B on one inf2 chip at TP=2, bf16, bucket 64.
BUDGETS = {
    "ttft_ms": 101.0,  # the published port's first-token prefill at the 64-token bucket (docs/design.md#performance-facts)
    # No decode figure is published: 2x the floor (one read of the ~23.8 GB of bf16 weights of both ranks
    # at the chip's HBM bandwidth, ~27 ms: roofline.py), a memory-bound step at 50% of peak bandwidth,
    # leaving room for the KV read, the all-reduces between the cores and the host round trip per token.
    "tpot_ms": 56.0,
}
DEFAULT_FACTOR = 1.1
DEFAULT_ALPHA = 0.01
# alpha must stay below 0.5: the interval level is 1 - 2 * alpha, and a one-sided test at 0.5 or
# more calls a coin toss significant.
MAX_ALPHA = 0.5


@dataclass
class MetricComparison:
    metric: str
    baseline_median: float | None
    current_median: float | None
    ratio: float | None
    p_value: float | None  # one-sided, current slower than baseline
    regressed: bool
    verdict: str
    p_faster: float | None = None  # one-sided, current faster than baseline
    improved: bool = False
    ci_low: float | None = None  # bootstrap interval of the ratio of medians
    ci_high: float | None = None
    confidence: float | None = None
    n_baseline: int = 0
    n_current: int = 0
    runs_needed: int | None = None  # runs a side that could reach alpha, when these cannot


@dataclass
class BudgetCheck:
    metric: str
    budget_ms: float
    current_median: float
    ok: bool


@dataclass
class Comparison:
    baseline_label: str
    current_label: str
    factor: float
    alpha: float
    metrics: list[MetricComparison] = field(default_factory=list)
    budgets: list[BudgetCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    change_points: list = field(default_factory=list)  # changepoints.ChangePoint, history only
    trend: dict = field(default_factory=dict)  # metric -> per-run medians and spreads (history, or the two files)
    plot: str | None = None  # the trend PNG, when one was drawn
    roofline: dict | None = None  # the current run's floors and efficiencies, when it has them
    # "outputs changed at prompt k step s ..." when the runs generated other tokens (no metric is
    # then called faster or slower, and the comparison fails), unless allowed
    output_change: str | None = None
    change_point_metrics: int = 0  # metrics tested for change points: the family Holm controls
    at_length: dict | None = None  # the current run's latency at each prompt length with its floors
    length_plot: str | None = None  # the latency-vs-length PNG, when one was drawn
    history: bool = False  # a history's runs (perf compare --history), else two files
    # "not comparable: ..." when the runs' machines were busy alike beyond perf/environment.py's bounds
    # (no metric is then called faster or slower, and the command exits 2)
    not_comparable: str | None = None

    @property
    def regressions(self) -> list[str]:
        return [m.metric for m in self.metrics if m.regressed]

    @property
    def broken_budgets(self) -> list[str]:
        return [b.metric for b in self.budgets if not b.ok]

    @property
    def failed(self) -> bool:
        return bool(self.regressions or self.broken_budgets or self.output_change)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(failed=self.failed, regressions=self.regressions, broken_budgets=self.broken_budgets)
        return d


def decide(ratio: float, p_slower: float, p_faster: float, enough: bool, factor: float,
           alpha: float) -> tuple[str, bool, bool]:
    """The decision rule: (verdict, regressed, improved)."""
    if not enough:
        return f"too few runs to test at alpha {alpha:g}", False, False
    if ratio > factor and p_slower < alpha:
        return "REGRESSION", True, False
    if ratio < 1 / factor and p_faster < alpha:
        return "faster", False, True
    if ratio > factor:
        return "slower, not significant", False, False
    if ratio < 1 / factor:
        return "faster, not significant", False, False
    if p_slower < alpha and ratio > 1:
        return f"slower, within factor {factor:g}", False, False
    if p_faster < alpha and ratio < 1:
        return f"faster, within factor {factor:g}", False, False
    return "ok", False, False


def compare_metric(metric: str, baseline, current, factor: float, alpha: float,
                   interval: bool = True) -> MetricComparison:
    if not baseline or not current:
        side = "baseline" if not current else "current"
        return MetricComparison(metric, _median(baseline), _median(current), None, None, False,
                                f"only in {side}", n_baseline=len(baseline or ()), n_current=len(current or ()))
    base, cur = statistics.median(baseline), statistics.median(current)
    ratio = cur / base if base > 0 else math.inf
    p_slower = stats.mann_whitney_greater(current, baseline)
    p_faster = stats.mann_whitney_less(current, baseline)
    enough = stats.smallest_p(len(current), len(baseline)) < alpha
    verdict, regressed, improved = decide(ratio, p_slower, p_faster, enough, factor, alpha)
    comp = MetricComparison(metric, base, cur, ratio, p_slower, regressed, verdict, p_faster, improved,
                            n_baseline=len(baseline), n_current=len(current))
    if not enough:
        comp.runs_needed = stats.runs_needed(alpha)
        comp.verdict += (f": {len(baseline)} vs {len(current)} runs can never give p < {alpha:g}; "
                         f"run at least {comp.runs_needed} a side")
    if interval and base > 0:
        comp.confidence = 1 - 2 * alpha
        comp.ci_low, comp.ci_high = stats.ratio_interval(baseline, current, comp.confidence)
    return comp


def _median(samples):
    return statistics.median(samples) if samples else None


def parse_budgets(items) -> dict[str, float]:
    """["ttft_ms=101", ...] -> {"ttft_ms": 101.0}."""
    budgets = {}
    for item in items or ():
        name, _, value = str(item).partition("=")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if not name.strip() or not limit > 0 or math.isinf(limit):
            raise HarnessInputError(f"--budget {item!r}: expected METRIC=MS with a positive number, "
                                    "e.g. ttft_ms=101")
        budgets[name.strip()] = limit
    return budgets


def check_budgets(current_samples: dict[str, list[float]], budgets: dict[str, float]) -> list[BudgetCheck]:
    checks = []
    for metric, limit in budgets.items():
        if metric not in current_samples:
            raise HarnessInputError(f"--budget {metric}: no such metric in the current run; use one "
                                    f"of {', '.join(current_samples)}")
        median = statistics.median(current_samples[metric])
        checks.append(BudgetCheck(metric, limit, median, median <= limit))
    return checks


def check_options(factor: float, alpha: float) -> None:
    if not factor >= 1 or not 0 < alpha < MAX_ALPHA:
        raise HarnessInputError(f"--factor {factor} / alpha {alpha}: need factor >= 1 and 0 < alpha < {MAX_ALPHA:g} "
                                "(the interval level is 1 - 2 * alpha)")


def compare_samples(baseline_samples, current_samples, factor: float = DEFAULT_FACTOR,
                    alpha: float = DEFAULT_ALPHA, budgets=None, baseline_label: str = "baseline",
                    current_label: str = "current", budget_pool=None, intervals: bool = True) -> Comparison:
    """Compare metric -> samples mappings; `baseline_samples` None means budgets only. Budgets are
    looked up in `budget_pool` (default: the current samples)."""
    check_options(factor, alpha)
    comp = Comparison(baseline_label, current_label, factor, alpha)
    if baseline_samples is not None:
        names = list(current_samples) + [m for m in baseline_samples if m not in current_samples]
        comp.metrics = [compare_metric(m, baseline_samples.get(m), current_samples.get(m), factor, alpha,
                                       intervals) for m in names]
    comp.budgets = check_budgets(budget_pool or current_samples, budgets or {})
    return comp


def check_comparable(baseline: dict, current: dict, allow_mismatch: bool = False,
                     baseline_label: str = "baseline", current_label: str = "current") -> list[str]:
    """Refuse runs that are not comparable; with allow_mismatch, return the differences as notes."""
    found = mismatches(baseline, current)
    diffs = [f"{name} differs ({baseline_label}: {a!r}, {current_label}: {b!r})" for name, a, b in found]
    other = [f"{name} {a or 'none'} vs {b or 'none'}" for name, a, b in found if name in CONFIGURATION_FIELDS]
    if other:  # another configuration: never a regression of one another, whatever --allow-mismatch says
        raise HarnessInputError(f"cannot compare these runs: {'; '.join(other)}: they are different configurations "
                                "(docs/quantization.md), not a baseline and its regression; compare each with runs "
                                "of its own configuration")
    if diffs and not allow_mismatch:
        raise HarnessInputError(
            f"cannot compare these runs: {'; '.join(diffs)}. Timings from different machines, models "
            "or settings are not comparable; compare runs made alike, or pass --allow-mismatch "
            "(allow_mismatch=True) to compare anyway."
        )
    return [f"mismatch allowed: {d}" for d in diffs]


def software_notes(baseline: dict, current: dict) -> list[str]:
    """What changed in the software between the runs: usually why the numbers moved."""
    notes = []
    old, new = baseline.get("versions", {}), current.get("versions", {})
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            notes.append(f"version of {name}: {old.get(name, 'absent')} -> {new.get(name, 'absent')}")
    if baseline.get("compiler_args") != current.get("compiler_args"):
        notes.append(f"compiler args: {baseline.get('compiler_args')} -> {current.get('compiler_args')}")
    return notes


def pin_outputs(comp: Comparison, baseline: dict, current: dict, allow_change: bool = False,
                baseline_label: str | None = None) -> None:
    """Refuse to call the current run faster or slower when it generated other tokens than the
    baseline (outputs.py): every metric's verdict is withheld and the comparison fails, unless
    `allow_change`, which keeps the verdicts and says what changed."""
    labels = (baseline_label or comp.baseline_label, comp.current_label)
    refusal, notes = outputs.compare_outputs(baseline, current, *labels)
    at_length, length_notes = pin_length_outputs(baseline, current, labels)
    per_batch, batch_notes = pin_batch_outputs(baseline, current, labels)
    comp.notes += notes + length_notes + batch_notes
    refusal = refusal or at_length or per_batch
    if refusal is None:
        return
    if allow_change:
        comp.notes.append(refusal.split(". Pass --allow-output-change")[0] + " (allowed by --allow-output-change)")
        return
    comp.output_change = refusal
    for m in comp.metrics:
        m.regressed = m.improved = False
        m.verdict = "not compared: the outputs changed"


def compare_results(baseline: dict | None, current: dict, factor: float = DEFAULT_FACTOR,
                    alpha: float = DEFAULT_ALPHA, budgets=None, allow_mismatch: bool = False,
                    baseline_label: str = "baseline", current_label: str = "current",
                    intervals: bool = True, allow_output_change: bool = False) -> Comparison:
    """Compare two bench results (machine, spec and settings must match unless allow_mismatch;
    their outputs must match unless allow_output_change)."""
    notes = []
    if baseline is not None:
        notes = check_comparable(baseline, current, allow_mismatch, baseline_label, current_label)
        notes += software_notes(baseline, current)
    comp = compare_samples(None if baseline is None else metric_samples(baseline),
                           metric_samples(current), factor, alpha, budgets, baseline_label, current_label,
                           budget_pool=budget_samples(current), intervals=intervals)
    if baseline is not None:
        from harness.perf.resolution import machine_rate_notes, resolution_notes

        notes += machine_rate_notes(baseline, current)
        notes += resolution_notes(metric_samples(baseline), metric_samples(current), alpha)
    comp.notes = notes + comp.notes
    comp.roofline = current.get("roofline")
    comp.at_length = current.get("at_length")
    if baseline is not None:
        pin_outputs(comp, baseline, current, allow_output_change)
        judge_environment(comp, baseline, current)
    return comp
