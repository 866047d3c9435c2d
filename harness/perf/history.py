"""`perf compare --history`: the newest run against the history's baseline, and the trend of every
metric over the runs, with its change points (changepoints.py).

The baseline of the newest run:
  1. DIR/baseline.json if present: a pinned run (copy a run file there to pin it);
  2. otherwise, per metric, the "median run" of the last HISTORY_WINDOW runs before the newest
     that are comparable with it (same machine, spec, backend, tp, dtype and prefill bucket): the
     run whose median is the upper median of their medians. One unusually fast or slow run never
     becomes the baseline, and the samples tested are one real run's, so run-to-run drift is not
     mistaken for a within-run signal (pooling every run's samples would be);
  3. no comparable earlier run: no baseline, budgets only (the first run on a new machine passes).
A step in the history shows as a change point once a few runs after it exist; the newest run
alone is judged by the comparison above.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from harness.perf import environment, stats
from harness.perf.changepoints import find_family, runs_needed
from harness.perf.compare import (DEFAULT_ALPHA, DEFAULT_FACTOR, Comparison, check_comparable, compare_results,
                                  compare_samples, pin_outputs, software_notes)
from harness.perf.results import BASELINE_FILE, COMPARABLE_FIELDS, load_history, load_result, mismatches
from harness.perf.samples import budget_samples, metric_samples

HISTORY_WINDOW = 5


def median_run_samples(runs: list[tuple[Path, dict]]) -> tuple[dict[str, list[float]], list[str]]:
    """Per metric, the samples of the run whose median is the upper median of the runs' medians
    (upper: when two runs tie for the middle, the slower one, which errs against false alarms)."""
    samples, notes = {}, []
    names = dict.fromkeys(m for _, r in reversed(runs) for m in metric_samples(r))  # newest's order
    for metric in names:
        having = [(statistics.median(metric_samples(r)[metric]), p.name, metric_samples(r)[metric])
                  for p, r in runs if metric in metric_samples(r)]
        having.sort(key=lambda h: h[0])
        median, name, chosen = having[len(having) // 2]
        samples[metric] = chosen
        notes.append(f"baseline {metric}: {name} (median run of {len(having)})")
    return samples, notes


def change_point_analysis(comp: Comparison, runs: list[tuple[Path, dict]], alpha: float) -> None:
    """Fill the comparison's trend and change points (family-wise over the metrics, Holm), and say
    so when the history is too short; keep the newest run's floors."""
    comp.roofline = runs[-1][1].get("roofline") if runs else None
    comp.at_length = runs[-1][1].get("at_length") if runs else None
    comp.trend, comp.history = trend(runs), True
    comp.change_points, comp.change_point_metrics = find_family(comp.trend, alpha)
    family = max(comp.change_point_metrics, 1)
    needed = runs_needed(alpha / family)
    if len(runs) < needed:
        comp.notes.append(f"change points: {len(runs)} comparable runs in the history; a step can be "
                          f"significant at family-wise alpha {alpha:g} over {family} metrics only with at "
                          f"least {needed} runs")


def compare_history(directory, factor: float = DEFAULT_FACTOR, alpha: float = DEFAULT_ALPHA,
                    budgets=None, allow_mismatch: bool = False, intervals: bool = True,
                    allow_output_change: bool = False) -> Comparison:
    """The newest run against the history's baseline (see the module docstring), with the trend
    and change points of the runs comparable with it. The newest run's outputs must equal those of
    the pinned baseline, else of the newest comparable earlier run (unless allow_output_change)."""
    directory = Path(directory)
    runs = load_history(directory)
    newest_path, newest = runs[-1]
    comparable = [(p, r) for p, r in runs if allow_mismatch or not mismatches(r, newest)]
    pinned = directory / BASELINE_FILE
    if pinned.is_file():
        comp = compare_results(load_result(pinned), newest, factor, alpha, budgets, allow_mismatch,
                               baseline_label=str(pinned), current_label=str(newest_path), intervals=intervals,
                               allow_output_change=allow_output_change)
        change_point_analysis(comp, comparable, alpha)
        return comp
    earlier = comparable[:-1][-HISTORY_WINDOW:]
    if not earlier:
        comp = compare_samples(None, metric_samples(newest), factor, alpha, budgets, "none", str(newest_path),
                               budget_pool=budget_samples(newest))
        comp.notes.append(f"no earlier run in {directory} comparable with the newest (same "
                          f"{', '.join(COMPARABLE_FIELDS)}): budgets checked only")
        change_point_analysis(comp, comparable, alpha)
        return comp
    quiet_alike = environment.alike(earlier, newest)  # the window's runs timed under a load like the newest's
    if quiet_alike and len(quiet_alike) < len(earlier):
        notes_env = [f"environment: {len(earlier) - len(quiet_alike)} of the last {len(earlier)} runs left out of "
                     "the baseline: the machine's other work then differed from the newest run's"]
        earlier = quiet_alike
    else:
        notes_env = []
    samples, notes = median_run_samples(earlier)
    comp = compare_samples(samples, metric_samples(newest), factor, alpha, budgets,
                           f"median run of the last {len(earlier)} comparable runs in {directory}",
                           str(newest_path), budget_pool=budget_samples(newest), intervals=intervals)
    newest_earlier = earlier[-1][1]
    comp.notes = (check_comparable(newest_earlier, newest, True) + software_notes(newest_earlier, newest)
                  + notes + notes_env)
    pin_outputs(comp, newest_earlier, newest, allow_output_change, baseline_label=str(earlier[-1][0]))
    environment.judge_environment(comp, newest_earlier, newest, baseline_label=str(earlier[-1][0]))
    change_point_analysis(comp, comparable, alpha)
    return comp


def trend(runs: list[tuple[Path, dict]]) -> dict[str, list[dict]]:
    """Per metric (compared metrics and latency), each run's median and p10/p90 spread."""
    out: dict[str, list[dict]] = {}
    for path, result in runs:
        for metric, values in budget_samples(result).items():
            out.setdefault(metric, []).append({
                "name": path.name, "commit": str(result.get("git_commit", "unknown")),
                "created": result["created"], "median": statistics.median(values),
                "p10": stats.percentile(values, 10), "p90": stats.percentile(values, 90), "n": len(values)})
    return out


def compare_files(baseline_path, current_path, **kwargs) -> Comparison:
    """Two result files; the comparison's trend holds their two points (what the plot draws)."""
    baseline, current = load_result(baseline_path), load_result(current_path)
    comp = compare_results(baseline, current, baseline_label=str(baseline_path), current_label=str(current_path),
                           **kwargs)
    comp.trend = trend([(Path(baseline_path), baseline), (Path(current_path), current)])
    return comp
