"""perf compare knows what it can see (harness/perf/resolution.py): the detectable change shrinks as
runs grow and grows with the spread, the advised --runs resolve the stated change, and differing
machine rates are warned about only beyond both runs' spreads."""

from __future__ import annotations

import random

import pytest

from harness.perf.compare import compare_results
from harness.perf.resolution import STATED_CHANGE, detectable_change, machine_rate_notes, runs_for
from tests.inputs.scenarios import perf_result


def noisy(n: int, center: float, spread: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [center * (1 + rng.gauss(0, spread)) for _ in range(n)]


def test_detectable_change_shrinks_with_runs_and_grows_with_spread():
    few = detectable_change(noisy(10, 50, 0.2, 1), noisy(10, 50, 0.2, 2), alpha=0.01)
    many = detectable_change(noisy(160, 50, 0.2, 1), noisy(160, 50, 0.2, 2), alpha=0.01)
    tight = detectable_change(noisy(10, 50, 0.02, 1), noisy(10, 50, 0.02, 2), alpha=0.01)
    assert many < few / 2.5 and tight < few / 5
    assert detectable_change([1.0], [1.0, 2.0], alpha=0.01) is None


def test_the_advised_runs_resolve_the_stated_change():
    base, cur = noisy(20, 50, 0.3, 3), noisy(20, 50, 0.3, 4)
    assert detectable_change(base, cur, 0.01) > STATED_CHANGE
    n = runs_for(base, cur, 0.01)
    assert detectable_change(noisy(n, 50, 0.3, 5), noisy(n, 50, 0.3, 6), 0.01) <= STATED_CHANGE * 1.3


def spread(median: float, low: float, high: float) -> dict:
    return {"roofline": {"rates_spread": {"memory_bytes_per_s": {"median": median, "min": low, "max": high, "n": 5}}}}


def test_machine_rates_warn_only_beyond_both_spreads():
    assert machine_rate_notes(spread(10e9, 9e9, 11e9), spread(10.5e9, 9.5e9, 12e9)) == []
    [note] = machine_rate_notes(spread(30e9, 28e9, 32e9), spread(10e9, 9e9, 11e9))
    assert "memory bandwidth" in note and "3.00x" in note
    assert machine_rate_notes({}, spread(10e9, 9e9, 11e9)) == []


def test_a_comparison_reports_its_resolution_and_the_runs_to_resolve_ten_percent():
    base = perf_result(decode=noisy(20, 5.0, 0.3, 7))
    cur = perf_result(decode=noisy(20, 5.0, 0.3, 8))
    notes = [n for n in compare_results(base, cur).notes if n.startswith("resolution: decode_ms_per_token")]
    assert len(notes) == 1 and "--runs" in notes[0], notes


@pytest.mark.slow  # about 11 CPU-seconds of benching (the pilot and the sized run)
def test_bench_runs_auto_sizes_the_run_from_a_pilot_within_the_cap(tmp_path, capsys, monkeypatch):
    import harness.cli.perf as perf_cli
    from harness.cli import main

    calls = []
    real = perf_cli.run_bench

    def counted(*args, **kwargs):
        calls.append(kwargs["runs"])
        return real(*args, **kwargs)

    monkeypatch.setattr(perf_cli, "run_bench", counted)
    out = tmp_path / "b.json"
    assert main(["bench", "--model", "tiny", "--runs", "auto", "--time-cap", "1", "--warmup", "0",
                 "--new-tokens", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert calls[0] == perf_cli.AUTO_PILOT_RUNS and len(calls) == 2 and "--runs auto:" in err
    assert calls[1] >= perf_cli.AUTO_PILOT_RUNS and out.is_file()
    assert main(["bench", "--model", "tiny", "--runs", "auto", "--time-cap", "nan", "--out", str(tmp_path / "c")]) == 2
