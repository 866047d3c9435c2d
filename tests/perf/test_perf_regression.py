"""Regression detection, budgets, comparability, history and `perf compare`, on synthetic samples.

No timing happens here: samples are drawn from seeded distributions, so every assertion is on
computed values and runs in well under a second per test.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from harness import perf
from harness.report import perf_text
from harness.base.errors import HarnessInputError
from harness.cli import main as cli_main

TRIALS = 200
N = 20  # samples per side, the bench default (perf.DEFAULT_RUNS)
ALPHA = perf.DEFAULT_ALPHA


def samples(rng: random.Random, median: float, noise: float, n: int = N, scale: float = 1.0) -> list[float]:
    """Log-normal timing noise (multiplicative, as timings are), rounded to 0.01 ms so ties occur."""
    return [round(median * scale * math.exp(rng.gauss(0.0, noise)), 2) for _ in range(n)]


def synthetic_result(prefill, decode, created="2026-01-01T00:00:00+00:00", commit="abc", **fields) -> dict:
    result = {
        "format": perf.FORMAT, "created": created, "git_commit": commit,
        "machine": {"cpu_model": "Test CPU", "cores": 2, "neuron_cores": 2, "hostname": "h"},
        "versions": {"python": "3.11"}, "compiler_args": [], "spec_hash": "spec0", "backend": "neuron",
        "tp": 2, "dtype": "bf16", "prefill_bucket": 64,
        "metrics": {"prefill_ms": prefill, "decode_ms_per_token": decode},
        "prefill_ms_by_bucket": {"64": prefill},
    }
    for dotted, value in fields.items():
        target = result
        *parents, last = dotted.split("__")
        for part in parents:
            target = target[part]
        target[last] = value
    return result


def pair(seed: int, scale: float, noise: float = 0.05):
    rng = random.Random(seed)
    base = synthetic_result(samples(rng, 100, noise), samples(rng, 30, noise))
    cur = synthetic_result(samples(rng, 100, noise, scale=scale), samples(rng, 30, noise, scale=scale))
    return base, cur


def binomial_upper_quantile(n: int, p: float, tail: float) -> int:
    """Smallest k with P(X > k) < tail for X ~ Binomial(n, p)."""
    cdf = 0.0
    for k in range(n + 1):
        cdf += math.comb(n, k) * p ** k * (1 - p) ** (n - k)
        if 1 - cdf < tail:
            return k
    return n


# ---- the U test ---------------------------------------------------------------------------------

def test_u_test_hand_computed_case():
    # current [3, 4, 5] vs baseline [1, 2]: U = 6, mean 3, variance 3*2/12*(5+1) = 3, no ties;
    # z = (6 - 3 - 0.5)/sqrt(3) = 1.4434, one-sided p = 0.07446.
    assert perf.mann_whitney_greater([3, 4, 5], [1, 2]) == pytest.approx(0.074457, abs=1e-5)
    assert perf.mann_whitney_less([1, 2], [3, 4, 5]) == pytest.approx(0.074457, abs=1e-5)
    assert perf.mann_whitney_greater([1, 2], [3, 4, 5]) > 0.9
    assert perf.mann_whitney_greater([2.0] * 5, [2.0] * 5) == 1.0  # all tied: no evidence


def test_smallest_p_and_runs_needed():
    # n a side, every current sample slower: U = n^2, z = (n^2/2 - 0.5) / sqrt(n^2 (2n+1) / 12).
    for n in (3, 5, 6, 20):
        z = (n * n / 2 - 0.5) / math.sqrt(n * n * (2 * n + 1) / 12)
        assert perf.smallest_p(n, n) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=1e-9)
    # n = 2, 3, 4, 5: z = 1.1619, 1.7457, 2.1651, 2.5071; one-sided p = 0.1226, 0.0404, 0.0152, 0.0061.
    assert perf.runs_needed(0.01) == 5
    assert perf.runs_needed(0.05) == 3
    assert perf.runs_needed(0.02) == 4


def test_percentiles_interpolate_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 6.0, 9.0, 7.0, 8.0]
    s = perf.summarize(values)
    assert (s["p50"], s["p90"], s["mean"], s["n"]) == (5.5, pytest.approx(9.1), 5.5, 10)
    assert perf.percentile([10.0], 99) == 10.0


def test_tail_percentiles_are_withheld_below_their_sample_size():
    """p90 from 10 samples, p99 from 100: from fewer, the "tail" is the sample's maximum."""
    nine, ten = [float(k) for k in range(9)], [float(k) for k in range(10)]
    assert perf.summarize(nine)["p90"] is None and perf.summarize(ten)["p90"] == pytest.approx(8.1)
    assert perf.summarize([float(k) for k in range(99)])["p99"] is None
    assert perf.summarize([float(k) for k in range(100)])["p99"] == pytest.approx(98.01)
    result = synthetic_result([10.0, 11.0, 12.0], [5.0] * 3)
    result["summary"] = {"prefill_ms": perf.summarize([10.0, 11.0, 12.0]), "tokens_per_second": 200.0}
    text = perf_text.render_bench_summary(result)
    assert "p90         -  p99         -" in text and "(n=3)" in text
    assert "p90 is shown from n >= 10 samples and p99 from n >= 100" in text


def test_alpha_help_states_the_range_that_is_accepted(tmp_path, capsys):
    """--alpha's help and its validation agree: (0, 0.5), the interval level 1 - 2 alpha above 0."""
    import re

    with pytest.raises(SystemExit):
        cli_main(["perf", "compare", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    low, high = map(float, re.search(r"--alpha ALPHA significance level, in \((\S+), (\S+)\)", help_text).groups())
    assert (low, high) == (0.0, 0.5)
    base, cur = tmp_path / "a.json", tmp_path / "b.json"
    for path in (base, cur):
        path.write_text(json.dumps(synthetic_result([10.0, 11.0, 12.0], [5.0, 5.1, 5.2])))
    argv = ["perf", "compare", "--baseline", str(base), "--current", str(cur), "--alpha"]
    assert cli_main(argv + ["0.49"]) == 0
    assert cli_main(argv + [str(high)]) == 2 and "(0, 0.5)" in capsys.readouterr().err
    assert cli_main(argv + [str(low)]) == 2


def test_the_ratio_interval_is_at_level_098_for_alpha_001():
    """The literal level: 1 - 2 * 0.01 = 0.98 (two-sided, matching the one-sided tests at alpha)."""
    rng = random.Random(7)
    base, cur = samples(rng, 100, 0.05), samples(rng, 110, 0.05)
    comp = perf.compare_metric("prefill_ms", base, cur, 1.1, 0.01)
    assert comp.confidence == 0.98
    assert (comp.ci_low, comp.ci_high) == perf.ratio_interval(base, cur, 0.98)
    narrower = perf.ratio_interval(base, cur, 0.90)
    assert comp.ci_low < narrower[0] and narrower[1] < comp.ci_high  # the level moves the bounds
    assert perf.compare_metric("prefill_ms", base, cur, 1.1, 0.05).confidence == 0.9


# ---- detection ----------------------------------------------------------------------------------

def test_twenty_percent_slowdown_alerts_in_every_trial():
    flagged = 0
    for seed in range(TRIALS):
        comp = perf.compare_results(*pair(seed, scale=1.2), intervals=False)
        flagged += comp.regressions == ["prefill_ms", "decode_ms_per_token"]
    assert flagged == TRIALS


def test_five_percent_slowdown_is_significant_but_below_factor():
    significant = flagged = 0
    for seed in range(TRIALS):
        base, cur = pair(seed, scale=1.05, noise=0.02)
        comp = perf.compare_results(base, cur, factor=1.1, intervals=False)
        significant += comp.metrics[0].p_value < ALPHA
        flagged += comp.failed
        assert comp.metrics[0].ratio == pytest.approx(1.05, abs=0.03)
    assert significant >= 0.95 * TRIALS  # the test sees it: the factor gate is what stops the alert
    assert flagged == 0


def test_too_few_runs_never_alert_and_say_why():
    base = synthetic_result([100.0, 101, 102], [30.0, 31, 32])
    cur = synthetic_result([200.0, 201, 202], [60.0, 61, 62])
    comp = perf.compare_results(base, cur)
    assert not comp.failed and not any(m.improved for m in comp.metrics)
    assert all(m.verdict.startswith("too few runs") for m in comp.metrics)
    assert all("run at least 5 a side" in m.verdict and m.runs_needed == 5 for m in comp.metrics)
    assert perf.smallest_p(3, 3) > ALPHA > perf.smallest_p(6, 6)
    # the interval is still given, within the extreme ratios a resample can have (decode: 60/32 to
    # 62/30), whatever the verdict
    assert all(60 / 32 <= m.ci_low <= m.ratio <= m.ci_high <= 62 / 30 for m in comp.metrics)


def test_faster_run_is_not_a_regression():
    comp = perf.compare_results(*pair(1, scale=0.7))
    assert not comp.failed and {m.verdict for m in comp.metrics} == {"faster"}
    assert all(m.improved and m.p_faster < ALPHA and m.ci_high < 1 for m in comp.metrics)


# ---- budgets --------------------------------------------------------------------------------------

def test_budget_checked_on_the_median_only():
    cur = synthetic_result([90.0, 100.0, 150.0], [20.0, 21.0, 22.0])
    ok = perf.compare_results(None, cur, budgets={"prefill_ms": 101, "decode_ms_per_token": 21})
    assert [b.ok for b in ok.budgets] == [True, True] and not ok.failed
    over = perf.compare_results(None, cur, budgets=perf.parse_budgets(["prefill_ms=99.5"]))
    assert over.broken_budgets == ["prefill_ms"] and over.budgets[0].current_median == 100.0


def test_budget_broken_without_regression_still_fails():
    base, cur = pair(3, scale=1.0)
    comp = perf.compare_results(base, cur, budgets={"decode_ms_per_token": 10.0})
    assert comp.regressions == [] and comp.broken_budgets == ["decode_ms_per_token"] and comp.failed


@pytest.mark.parametrize("item", ["prefill_ms", "prefill_ms=", "prefill_ms=fast", "=101", "prefill_ms=-1",
                                  "prefill_ms=inf"])
def test_bad_budget_is_refused(item):
    with pytest.raises(HarnessInputError, match="METRIC=MS"):
        perf.parse_budgets([item])


def test_budget_on_unknown_metric_names_the_metrics():
    with pytest.raises(HarnessInputError, match="prefil_ms.*decode_ms_per_token"):
        perf.compare_results(None, synthetic_result([1.0], [1.0]), budgets={"prefil_ms": 101})


def test_published_budgets_live_in_one_place():
    assert perf.BUDGETS["ttft_ms"] == 101.0
    # decode: headroom over the 28 ms weight-read floor (23 GB at 820 GB/s), docs/design.md#performance-facts
    assert 23e9 / 820e9 * 1e3 < perf.BUDGETS["tpot_ms"] <= 3 * 28.0


# ---- comparability ------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("machine__cpu_model", "Other CPU"), ("machine__neuron_cores", 32),
                                         ("spec_hash", "spec1"), ("backend", "cpu"), ("dtype", "fp32")])
def test_mismatched_runs_are_refused_naming_the_field(field, value):
    base, cur = pair(0, scale=1.0)
    other = synthetic_result(cur["metrics"]["prefill_ms"], cur["metrics"]["decode_ms_per_token"], **{field: value})
    with pytest.raises(HarnessInputError, match=field.replace("__", r"\.") + " differs"):
        perf.compare_results(base, other)
    allowed = perf.compare_results(base, other, allow_mismatch=True)
    assert any(field.replace("__", ".") in note for note in allowed.notes)
    assert len(allowed.metrics) == 2


def test_hostname_and_versions_do_not_block_but_are_noted():
    base, cur = pair(0, scale=1.0)
    cur["machine"]["hostname"] = "another-runner"
    cur["versions"]["neuronx-cc"] = "2.27"
    comp = perf.compare_results(base, cur)
    assert any("neuronx-cc: absent -> 2.27" in n for n in comp.notes)


# ---- history --------------------------------------------------------------------------------------

def history_run(seed: int, scale: float, minute: int, **fields) -> dict:
    rng = random.Random(seed)
    return synthetic_result(samples(rng, 100, 0.05, scale=scale), samples(rng, 30, 0.05, scale=scale),
                            created=f"2026-01-01T00:{minute:02d}:00+00:00", commit=f"c{minute:02d}", **fields)


def test_history_never_overwrites(tmp_path):
    run = history_run(0, 1.0, 0)
    first = perf.append_history(run, tmp_path)
    before = first.read_bytes()
    second = perf.append_history(run, tmp_path)
    assert first != second and first.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])
    with pytest.raises(HarnessInputError, match="never overwritten"):
        perf.write_json(first, {"format": 0})
    assert first.read_bytes() == before and perf.load_result(second) == run


def test_history_compare_flags_newest_slowdown_against_median_run(tmp_path):
    for minute in range(5):  # one earlier run is an outlier (2x slow): the median run ignores it
        perf.append_history(history_run(minute, 2.0 if minute == 2 else 1.0, minute), tmp_path)
    perf.append_history(history_run(99, 1.2, 10), tmp_path)
    comp = perf.compare_history(tmp_path)
    assert comp.regressions == ["prefill_ms", "decode_ms_per_token"]
    assert "last 5 comparable runs" in comp.baseline_label and "c10" in comp.current_label
    assert all(m.ratio == pytest.approx(1.2, abs=0.06) for m in comp.metrics)


def test_history_compare_of_an_unchanged_newest_run_is_ok(tmp_path):
    for minute in range(4):
        perf.append_history(history_run(minute, 2.0 if minute == 1 else 1.0, minute), tmp_path)
    perf.append_history(history_run(50, 1.0, 9), tmp_path)
    comp = perf.compare_history(tmp_path)
    assert not comp.failed and all(m.ratio < 1.1 for m in comp.metrics)


def test_pinned_baseline_file_wins(tmp_path):
    perf.write_json(tmp_path / perf.BASELINE_FILE, history_run(1, 0.5, 0))
    perf.append_history(history_run(2, 1.0, 1), tmp_path)
    comp = perf.compare_history(tmp_path)
    assert comp.baseline_label.endswith(perf.BASELINE_FILE) and comp.regressions == ["prefill_ms", "decode_ms_per_token"]


def test_history_skips_runs_from_other_machines(tmp_path):
    perf.append_history(history_run(1, 0.5, 0, machine__cpu_model="Other CPU"), tmp_path)
    perf.append_history(history_run(2, 1.0, 1), tmp_path)
    comp = perf.compare_history(tmp_path, budgets={"prefill_ms": 101})
    assert comp.metrics == [] and [b.ok for b in comp.budgets] == [True]
    assert any("budgets checked only" in n for n in comp.notes)
    assert perf.compare_history(tmp_path, allow_mismatch=True).regressions  # 2x slower than the other


def test_corrupt_history_file_is_named(tmp_path):
    perf.append_history(history_run(1, 1.0, 0), tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(HarnessInputError, match="broken.json: not valid JSON"):
        perf.compare_history(tmp_path)


# ---- perf compare, through the argparse wiring ----------------------------------------------------

def run_cli(*argv) -> int:
    return cli_main([str(a) for a in argv])


def test_compare_cli_exit_codes_and_reports(tmp_path, capsys):
    base, cur = pair(5, scale=1.3)
    perf.write_json(tmp_path / "base.json", base)
    perf.write_json(tmp_path / "cur.json", cur)
    perf.write_json(tmp_path / "same.json", pair(5, scale=1.0)[1])
    md, js = tmp_path / "perf.md", tmp_path / "perf.json"
    assert run_cli("perf", "compare", "--baseline", tmp_path / "base.json", "--current", tmp_path / "cur.json",
                   "--markdown", md, "--json", js) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert "| prefill_ms |" in md.read_text() and "REGRESSION" in md.read_text()
    assert json.loads(js.read_text())["regressions"] == ["prefill_ms", "decode_ms_per_token"]
    assert run_cli("perf", "compare", "--baseline", tmp_path / "base.json", "--current", tmp_path / "same.json",
                   "--budget", "prefill_ms=101", "--markdown", md) == 0
    assert "budget prefill_ms" in md.read_text()
    assert run_cli("perf", "compare", "--baseline", tmp_path / "base.json", "--current", tmp_path / "same.json",
                   "--budget", "prefill_ms=50") == 1


def test_compare_cli_bad_input_exits_2(tmp_path, capsys):
    base, cur = pair(5, scale=1.0)
    cur["spec_hash"] = "other"
    perf.write_json(tmp_path / "base.json", base)
    perf.write_json(tmp_path / "cur.json", cur)
    assert run_cli("perf", "compare", "--baseline", tmp_path / "base.json", "--current", tmp_path / "cur.json") == 2
    assert "spec_hash differs" in capsys.readouterr().err
    assert run_cli("perf", "compare", "--baseline", tmp_path / "base.json", "--current", tmp_path / "cur.json",
                   "--allow-mismatch") == 0
    assert run_cli("perf", "compare", "--baseline", tmp_path / "base.json") == 2
    assert run_cli("perf", "compare", "--history", tmp_path / "missing") == 2
    assert "history directory not found" in capsys.readouterr().err
    assert run_cli("perf", "compare", "--baseline", tmp_path / "nope.json", "--current", tmp_path / "cur.json") == 2
    (tmp_path / "old.json").write_text(json.dumps({"format": 0}))
    assert run_cli("perf", "compare", "--baseline", tmp_path / "old.json", "--current", tmp_path / "cur.json") == 2
    assert "not a perf result of format 1" in capsys.readouterr().err
