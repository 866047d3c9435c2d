"""Change points over the history (CUSUM with a permutation p-value, binary segmentation), on
synthetic run medians and through `perf compare --history`, including the trend PNG.

Numbers. On flat noise (16 runs, 3% log-normal noise per run median) at alpha = 0.05, the chance of
reporting any change point is alpha by construction (the permutation test is exact when runs are
exchangeable): over FLAT_TRIALS = 1000 histories the count is Binomial(1000, 0.05), accepted up to
its 99.9% quantile, 73 (a doubled rate, mean 100, exceeds it with probability 0.998). A +20% step
planted at run 12 of 20 (same noise, alpha 0.01) must be found exactly there in at least 95% of
STEP_TRIALS = 300 histories (an off-by-one location happens when a run next to the step draws
noise of about half the step; a second, spurious split inside a segment happens at rate alpha).

The family. `perf compare --history` tests FAMILY = 5 metrics at once; with Holm's step-down the
chance of any change point on histories with no change in any metric stays at most alpha. With
independent metrics (the worst case for the family) it is 1 - (1 - alpha/5)^5 = 0.096 at alpha 0.1:
over FAMILY_TRIALS = 400 histories the count must fall in Binomial(400, 0.1)'s central 99.8%
[lo, hi] = [23, 60]. Each metric at alpha alone alarms at 1 - 0.9^5 = 0.41 (about 164): the test
catches a dropped correction, and a doubled family rate (mean 80) exceeds hi with probability 0.99.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from harness import perf
from harness.report import perf_plot, perf_text
from harness.cli import main as cli_main
from harness.perf import changepoints

from tests.perf.test_decision_rule import binom_quantiles
from tests.perf.test_perf_regression import samples, synthetic_result

FLAT_TRIALS, STEP_TRIALS, FAMILY_TRIALS = 1000, 300, 400
FAMILY = ("prefill_ms", "decode_ms_per_token", "ttft_ms", "tpot_ms", "e2e_ms")


def history(rng: random.Random, runs: int, step_at: int | None, scale: float, noise: float = 0.03) -> list[dict]:
    return [{"name": f"run{i:02d}.json", "commit": f"c{i:02d}", "created": f"2026-01-01T00:{i:02d}:00+00:00",
             "median": 100 * (scale if step_at is not None and i >= step_at else 1.0) * math.exp(rng.gauss(0, noise))}
            for i in range(runs)]


def test_statistic_and_location_on_a_hand_checked_case():
    # log-values 0,0,0,1,1,1 (mean 0.5): C_3 = |3 * -0.5| / sqrt(3 * 3 / 6) = 1.5 / 1.2247 = 1.2247,
    # the largest; only the two orders with the three high values together reach it: 2 of C(6, 3) = 20,
    # so p is about 2/20 = 0.1.
    values = [1.0, 1.0, 1.0, math.e, math.e, math.e]
    split, stat, p = changepoints.cusum(values)
    assert split == 3 and stat == pytest.approx(1.5 / math.sqrt(1.5))
    assert p == pytest.approx(0.1, abs=0.02)


def test_flat_noise_false_alarm_rate_is_alpha():
    _, hi = binom_quantiles(FLAT_TRIALS, 0.05, 1e-3)
    assert hi == 73
    rng = random.Random(5)
    alarms = sum(bool(changepoints.find_change_points("m", history(rng, 16, None, 1.0), 0.05))
                 for _ in range(FLAT_TRIALS))
    assert alarms <= hi


def test_planted_step_is_found_where_it_was_planted():
    rng = random.Random(3)
    exact = 0
    for _ in range(STEP_TRIALS):
        found = changepoints.find_change_points("prefill_ms", history(rng, 20, 12, 1.2), 0.01)
        exact += [cp.index for cp in found] == [12]
        step = next((cp for cp in found if cp.index == 12), None)
        if step is not None:
            assert (step.commit, step.run, step.direction) == ("c12", "run12.json", "slower")
            assert step.ratio == pytest.approx(1.2, rel=0.05) and step.p_value < 0.01
    assert exact >= 0.95 * STEP_TRIALS


def test_too_few_runs_cannot_find_a_step():
    # A perfect +50% step in 7 runs: its permutation p is about 2 / C(7, 3) = 0.057 > 0.01.
    assert changepoints.runs_needed(0.01) == 10  # 2 / C(10, 5) = 0.0079 < 0.01; 2 / C(9, 4) = 0.016
    values = history(random.Random(0), 7, 4, 1.5, noise=0.001)
    assert changepoints.find_change_points("m", values, 0.01) == []


def test_the_family_of_metrics_keeps_its_false_alarm_rate_at_alpha(monkeypatch):
    lo, hi = binom_quantiles(FAMILY_TRIALS, 0.1, 1e-3)
    assert (lo, hi) == (23, 60)
    first_p = {}  # each history's CUSUM computed once, for the family and for the metrics alone
    cusum = changepoints.cusum
    monkeypatch.setattr(changepoints, "cusum", lambda values: first_p.setdefault(tuple(values), cusum(values)))
    rng = random.Random(11)
    family_alarms = single_alarms = 0
    for _ in range(FAMILY_TRIALS):
        trend = {m: history(rng, 12, None, 1.0) for m in FAMILY}
        found, tested = changepoints.find_family(trend, 0.1)
        assert tested == len(FAMILY)
        family_alarms += bool(found)
        single_alarms += any(changepoints.cusum([r["median"] for r in runs])[2] < 0.1 for runs in trend.values())
    assert lo <= family_alarms <= hi
    assert single_alarms > hi  # without the correction the family alarms far more often than alpha


def test_holm_tests_the_smallest_p_at_alpha_over_the_family_size():
    # A perfect +50% step in 10 runs: p = 2 / C(10, 5) + 1/2000 = 0.0084. Alone it is a change point at
    # alpha 0.01; among five metrics its level is 0.01 / 5 = 0.002 and it is not.
    stepped = history(random.Random(0), 10, 5, 1.5, noise=0.001)
    assert changepoints.cusum([r["median"] for r in stepped])[2] == pytest.approx(0.0084, abs=0.002)
    assert [cp.index for cp in changepoints.find_change_points("prefill_ms", stepped, 0.01)] == [5]
    flat = {m: history(random.Random(k), 10, None, 1.0) for k, m in enumerate(FAMILY[1:])}
    assert changepoints.find_family({"prefill_ms": stepped, **flat}, 0.01) == ([], 5)
    assert [cp.index for cp in changepoints.find_family({"prefill_ms": stepped}, 0.01)[0]] == [5]
    # with 14 runs (p = 2 / C(14, 7) + 1/2000 = 0.0011 < 0.002) the family finds it, and only it
    longer = history(random.Random(0), 14, 7, 1.5, noise=0.001)
    flat = {m: history(random.Random(k), 14, None, 1.0) for k, m in enumerate(FAMILY[1:])}
    found, tested = changepoints.find_family({"prefill_ms": longer, **flat}, 0.01)
    assert [(cp.metric, cp.index) for cp in found] == [("prefill_ms", 7)] and tested == 5


# ---- through the history and the command ------------------------------------------------------------

def write_history(directory, medians: list[float], seed: int = 0) -> None:
    rng = random.Random(seed)
    for i, median in enumerate(medians):
        result = synthetic_result(samples(rng, median, 0.02), samples(rng, 30, 0.02),
                                  created=f"2026-01-01T00:{i:02d}:00+00:00", commit=f"commit{i:02d}")
        perf.append_history(result, directory)


def test_history_names_the_commit_of_the_first_slow_run(tmp_path):
    write_history(tmp_path, [100.0] * 8 + [125.0] * 6)
    comp = perf.compare_history(tmp_path, intervals=False)
    steps = [cp for cp in comp.change_points if cp.metric == "prefill_ms"]
    assert [(cp.index, cp.commit, cp.direction) for cp in steps] == [(8, "commit08", "slower")]
    assert steps[0].ratio == pytest.approx(1.25, rel=0.03)
    assert not [cp for cp in comp.change_points if cp.metric == "decode_ms_per_token"]
    text = perf_text.render_text(comp)
    assert sum("commit08" in line and "slower" in line for line in text.splitlines()) == 1  # printed once
    assert f"family-wise alpha 0.01 over the {comp.change_point_metrics} metrics tested, Holm" in text
    assert [p["commit"] for p in comp.trend["prefill_ms"]] == [f"commit{i:02d}" for i in range(14)]


def test_short_history_says_how_many_runs_are_needed(tmp_path):
    write_history(tmp_path, [100.0] * 3 + [150.0] * 3)
    comp = perf.compare_history(tmp_path, intervals=False)
    assert comp.change_points == []
    # five metrics (prefill, decode, TTFT, TPOT, E2E... as recorded: here prefill and decode), Holm:
    # the smallest p must beat 0.01 / 2 = 0.005: 2 / C(11, 5) + 1/2000 = 0.0049 first does
    assert comp.change_point_metrics == 2
    assert any("6 comparable runs" in n and "over 2 metrics only with at least 11 runs" in n for n in comp.notes)


def test_compare_history_writes_the_trend_png_beside_the_markdown(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the trend PNG needs the plot extra (matplotlib)")
    hist = tmp_path / "history"
    write_history(hist, [100.0] * 8 + [125.0] * 6)
    md, js = tmp_path / "perf.md", tmp_path / "perf.json"
    code = cli_main(["perf", "compare", "--history", str(hist), "--budget", "prefill_ms=120",
                     "--markdown", str(md), "--json", str(js)])
    assert code == 1  # the newest run is over the 120 ms budget
    png = tmp_path / "perf-trend.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "![trend of the run medians](perf-trend.png)" in md.read_text()
    assert "commit08" in md.read_text() and "Change points" in md.read_text()
    payload = json.loads(js.read_text())
    assert payload["plot"] == str(png) and payload["change_points"][0]["commit"] == "commit08"
    assert f"trend plot: {png}" in capsys.readouterr().out


def test_trend_png_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.report.perf_plot.plot_available", lambda: False)
    write_history(tmp_path, [100.0] * 4)
    comp = perf.compare_history(tmp_path, intervals=False)
    assert perf_plot.draw_trend(comp, tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()
    assert any("matplotlib is not installed" in n for n in comp.notes)


def test_the_trend_plot_labels_at_most_twenty_runs_however_long_the_history():
    """One label per run made a 10,000-run history's plot take minutes; the first and the newest
    run are always labelled."""
    pytest.importorskip("matplotlib", reason="the trend PNG needs the plot extra (matplotlib)")
    from matplotlib.figure import Figure

    from harness.report import perf_plot as plot

    assert plot.tick_positions(5) == [0, 1, 2, 3, 4]
    for n in (21, 100, 999, 10_000):
        ticks = plot.tick_positions(n)
        assert len(ticks) <= 20 and ticks[0] == 0 and ticks[-1] == n - 1 and ticks == sorted(set(ticks))
    points = [{"median": 100.0, "p10": 99.0, "p90": 101.0, "commit": f"{k:07d}"} for k in range(2000)]
    ax = Figure().subplots()
    plot._panel(ax, "prefill_ms", points, perf.Comparison("a", "b", 1.1, 0.01), None)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert len(labels) <= 20 and labels[0] == "0000000" and labels[-1] == "0001999"
