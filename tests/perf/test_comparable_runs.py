"""`perf compare` on a shared machine (issue 49): two runs whose machines did other work beyond
perf/environment.py's bounds are "not comparable" (exit 2, never REGRESSION), while a planted +20%
between runs timed alike still alerts. The docs' recipe (docs/performance.md: bench twice, then
compare) is run on results with recorded environments, so nothing here depends on this machine's load.

The timing model: a run's samples are the code's time x (1 + LOAD_COST x the share of the CPU other
processes took) x log-normal noise whose width grows with that share, as a busy 2-core machine showed
(docs/performance.md#comparable-runs: a tiny bench at load 10 took others_cpu 0.77).
"""

from __future__ import annotations

import json
import math
import random

import pytest

from harness import FIXTURES_DIR, perf
from harness.cli import main as cli_main
from harness.perf import environment

N = 20  # runs a side: the recipe's --runs 20
LOAD_COST = 0.35  # others_cpu 0.66 -> +23%: the identical-code "regression" at load 4-7


def env(others: float, steal: float = 0.0, mhz: float = 2000.0) -> dict:
    return {"window_s": 60.0, "cores": 2, "load_1m": [1.0 + 8 * others, 1.0 + 8 * others], "cpu_mhz": mhz,
            "others_cpu": others, "steal": steal, "cpu_stall": others}


def run(seed: int, others: float, slowdown: float = 1.0, **env_fields) -> dict:
    """A bench result of code taking `slowdown` x the base time, timed while others used `others`."""
    rng = random.Random(seed)
    scale = slowdown * (1 + LOAD_COST * others)
    noise = 0.03 + 0.10 * others

    def draw(median):
        return [round(median * scale * math.exp(rng.gauss(0.0, noise)), 3) for _ in range(N)]

    prefill = draw(480.0)
    return {"format": perf.FORMAT, "created": f"2026-12-07T14:{seed % 60:02d}:00+00:00", "git_commit": "c0ffee",
            "machine": {"cpu_model": "Test CPU", "cores": 2, "neuron_cores": 0, "hostname": "h"},
            "versions": {"python": "3.11"}, "compiler_args": [], "spec_hash": "spec0", "backend": "cpu", "tp": 2,
            "dtype": "bf16", "prefill_bucket": 64, "metrics": {"prefill_ms": prefill, "decode_ms_per_token": draw(150.0)},
            "prefill_ms_by_bucket": {"64": prefill}, "environment": env(others, **env_fields)}


def compare(tmp_path, base: dict, cur: dict, capsys) -> tuple[int, str, str]:
    a, b = tmp_path / "base.json", tmp_path / "bench.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(cur))
    code = cli_main(["perf", "compare", "--baseline", str(a), "--current", str(b)])
    out, err = capsys.readouterr()
    return code, out, err


def test_without_the_rule_load_alone_reads_as_a_regression():
    """The fault the rule is for: identical code, a quiet baseline, a busy current run."""
    base, cur = run(1, others=0.02), run(2, others=0.66)
    for r in (base, cur):
        del r["environment"]  # what every result looked like before bench recorded the machine
    comp = perf.compare_results(base, cur)
    assert comp.regressions and not comp.not_comparable
    assert any("not recorded" in n for n in comp.notes)


@pytest.mark.parametrize("seed", range(8))
def test_identical_code_under_load_says_not_comparable(tmp_path, capsys, seed):
    code, out, err = compare(tmp_path, run(10 + seed, others=0.02), run(20 + seed, others=0.66), capsys)
    assert code == 2, out
    assert "REGRESSION" not in out and "perf: NOT COMPARABLE" in out
    assert "not comparable" in err and "other processes used 2% vs 66% of the CPU" in err
    assert "other processes took 66% of the CPU during" in err  # over the limit of one run, too


def test_identical_code_both_runs_busy_alike_says_not_comparable(tmp_path, capsys):
    """Both runs at the same heavy load: alike on average, yet no measurement (the recorded pair below)."""
    code, out, err = compare(tmp_path, run(25, others=0.77), run(26, others=0.80), capsys)
    assert code == 2 and "REGRESSION" not in out
    assert "took 77% of the CPU during" in err and "took 80% of the CPU during" in err


@pytest.mark.parametrize("seed", range(8))
def test_identical_code_both_runs_quiet_passes(tmp_path, capsys, seed):
    code, out, _ = compare(tmp_path, run(30 + seed, others=0.02), run(40 + seed, others=0.11), capsys)
    assert code == 0, out
    assert out.startswith("perf: ok")


@pytest.mark.parametrize("others", [0.0, 0.15])
def test_a_planted_20_percent_slowdown_alerts(tmp_path, capsys, others):
    code, out, _ = compare(tmp_path, run(50, others=others), run(51, others=others + 0.08, slowdown=1.2), capsys)
    assert code == 1 and "REGRESSION" in out and out.startswith("perf: FAILED (regression in"), out


RECORDED = FIXTURES_DIR / "perf"


def test_the_recorded_busy_pair_is_not_comparable(tmp_path, capsys):
    """Two real `bench --model tiny --runs 20` results of the same commit on a shared 2-core machine at
    load 9-12 (recorded for issue 49): without the rule `perf compare` called prefill a REGRESSION
    (ratio 1.26, p 0.007); with it, not comparable."""
    base, cur = (json.loads((RECORDED / f"busy-{k}.json").read_text()) for k in "ab")
    plain = [dict(r, environment=None) for r in (base, cur)]
    for r in plain:
        r["roofline"] = {k: v for k, v in r["roofline"].items() if k != "rates_spread"}
    assert perf.compare_results(*plain).regressions  # the fault, as the issue saw it
    code, out, err = compare(tmp_path, base, cur, capsys)
    assert code == 2 and "REGRESSION" not in out and "not comparable" in err


def test_the_recorded_pair_with_a_planted_slowdown_between_quiet_runs_alerts(tmp_path, capsys):
    """The recorded runs' samples with their machine made quiet (others_cpu 0.02) and the current run's
    every timing x 1.2: the rule lets the comparison through and the +20% alerts."""
    base = json.loads((RECORDED / "busy-a.json").read_text())
    quiet = dict(base["environment"], others_cpu=0.02)
    cur = json.loads(json.dumps(base))
    for key in ("prefill_ms", "decode_ms_per_token"):
        cur["metrics"][key] = [x * 1.2 for x in cur["metrics"][key]]
    cur["prefill_ms_by_bucket"] = {b: [x * 1.2 for x in v] for b, v in cur["prefill_ms_by_bucket"].items()}
    base["environment"] = cur["environment"] = quiet
    code, out, _ = compare(tmp_path, base, cur, capsys)
    assert code == 1 and "REGRESSION" in out, out


def test_the_bounds_are_the_stated_ones():
    """At the bound comparable, past it not: others_cpu and steal in points, the clock as a fraction."""
    bound = environment.BOUNDS
    assert environment.differences(env(0.30), env(0.30 + bound["others_cpu"] - 1e-9)) == []
    assert environment.differences(env(0.30), env(0.30 + bound["others_cpu"] + 1e-3))
    assert environment.differences(env(0.0, steal=0.0), env(0.0, steal=bound["steal"] + 1e-3))
    assert environment.differences(env(0.0, mhz=2000), env(0.0, mhz=2000 * (1 + bound["cpu_mhz"]) - 1)) == []
    assert environment.differences(env(0.0, mhz=2000), env(0.0, mhz=2000 * (1 + bound["cpu_mhz"]) + 2))
    assert environment.differences(env(0.0), None) is None  # an old result: nothing to judge
    assert environment.busy(env(environment.LIMITS["others_cpu"]), "a") == []
    assert environment.busy(env(environment.LIMITS["others_cpu"] + 1e-3), "a")
    assert environment.busy(env(0.0, steal=environment.LIMITS["steal"] + 1e-3), "a")


def test_steal_or_a_slower_clock_alone_make_runs_not_comparable(tmp_path, capsys):
    code, _, err = compare(tmp_path, run(60, 0.02), run(61, 0.02, steal=0.08), capsys)
    assert code == 2 and "steal used 0% vs 8% of the CPU" in err
    code, _, err = compare(tmp_path, run(62, 0.02), run(63, 0.02, mhz=1500.0), capsys)
    assert code == 2 and "the clock was 2000 vs 1500 MHz" in err


def test_not_comparable_keeps_budgets_and_output_changes_failing(tmp_path, capsys):
    base, cur = run(70, 0.02), run(71, 0.66)
    comp = perf.compare_results(base, cur, budgets={"prefill_ms": 100.0})
    assert comp.not_comparable and comp.broken_budgets == ["prefill_ms"] and comp.failed
    assert all(m.verdict == "not compared: the machine differed" for m in comp.metrics)


def test_a_history_leaves_runs_at_another_load_out_of_the_baseline(tmp_path, capsys):
    """--history: earlier runs timed at another load than the newest are left out of its baseline;
    when none is left the comparison is not comparable (exit 2)."""
    other_load = [run(80 + k, 0.20) for k in range(3)]
    same_load = [run(90 + k, 0.02) for k in range(2)]
    for k, r in enumerate(other_load + same_load):
        r["created"] = f"2026-12-07T15:{k:02d}:00+00:00"
        perf.append_history(r, tmp_path / "h")
    newest = run(99, 0.04)
    newest["created"] = "2026-12-07T15:30:00+00:00"
    perf.append_history(newest, tmp_path / "h")
    comp = perf.compare_history(tmp_path / "h")
    assert not comp.not_comparable and not comp.regressions
    assert any("3 of the last 5 runs left out" in n for n in comp.notes), comp.notes
    none_alike = tmp_path / "q"
    for r in other_load:
        perf.append_history(r, none_alike)
    perf.append_history(newest, none_alike)
    assert cli_main(["perf", "compare", "--history", str(none_alike)]) == 2
    assert "not comparable" in capsys.readouterr().err


def test_the_record_is_computed_from_the_kernel_counters(tmp_path, monkeypatch):
    """others_cpu = (the machine's busy time - this process's CPU time) / (window x cores); steal and
    the stall likewise; the counters are files, faked here."""
    stat, psi = tmp_path / "stat", tmp_path / "psi"
    monkeypatch.setattr(environment, "PROC_STAT", stat)
    monkeypatch.setattr(environment, "PROC_PSI", psi)
    monkeypatch.setattr(environment, "TICKS", 100)
    monkeypatch.setattr(environment.os, "cpu_count", lambda: 2)
    clock, own = iter([100.0, 110.0]), iter([5.0, 12.0])
    monkeypatch.setattr(environment.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(environment, "_own_cpu", lambda: next(own))

    def counters(user, system, steal, stall_us):
        stat.write_text(f"cpu  {user} 0 {system} 9999 0 0 0 {steal} 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
        psi.write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={stall_us}\nfull avg10=0 total=0\n")

    since = getattr(environment.since, "__wrapped__", environment.since)  # the measured one (conftest.py)
    counters(1000, 500, 10, 1_000_000)
    start = environment.probe()
    counters(1000 + 1200, 500 + 300, 10 + 100, 4_000_000)  # 15 s busy, 1 s steal, 3 s stalled, in 10 s
    record = since(start)
    assert record["others_cpu"] == pytest.approx((15 - 7) / 20)  # 7 s of it was this process's
    assert record["steal"] == pytest.approx(1 / 20) and record["cpu_stall"] == pytest.approx(0.3)
    assert record["window_s"] == 10.0 and record["cores"] == 2
