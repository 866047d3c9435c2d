"""`bench --assistant DIR --speculate K` (harness/perf/speculative.py): the modeled speed-up's
arithmetic and the option pairing (default lane); on the mirror pair (slow) the block reports
accepted drafts per verify and the speed-up, and an engine capped at one accepted draft shows in it."""

from __future__ import annotations

import json

import pytest

from harness.perf.speculative import modeled_speedup


def test_modeled_speedup_is_tokens_per_round_over_the_rounds_weight_reads():
    assert modeled_speedup(2.0, 3, 0, 100) == 3.0  # a free drafter: accepted + 1 tokens per verify
    assert abs(modeled_speedup(2.0, 3, 10, 100) - 3.0 / 1.3) < 1e-12  # three draft steps read 3 x 10%
    assert modeled_speedup(0.0, 3, 10, 100) < 1.0  # nothing accepted: slower than plain decode


@pytest.mark.slow  # ~3 s of CPU (the checkpoint opened first): over the default lane's per-test budget
def test_speculate_without_an_assistant_is_refused_before_model_work(tiny0_dir, tmp_path, capsys):
    from harness.cli import main as cli

    code = cli(["bench", "--checkpoint", str(tiny0_dir), "--speculate", "3", "--out", str(tmp_path / "b.json")])
    assert code == 2 and "--speculate needs --assistant DIR" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def _bench(tmp_path, name: str) -> dict:
    from harness.cli import main as cli
    from harness.reference.mirror_assistant import mirror_pair

    target, assistant = mirror_pair(0)
    out = tmp_path / f"{name}.json"
    code = cli(["bench", "--checkpoint", str(target), "--assistant", str(assistant), "--speculate", "3", "--runs", "2",
                "--warmup", "0", "--new-tokens", "12", "--buckets", "16", "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())["speculative"]


@pytest.mark.slow
def test_bench_reports_acceptance_and_speedup_and_sees_a_capped_engine(tmp_path, monkeypatch):
    from harness.port import speculate as port_speculate

    healthy = _bench(tmp_path, "healthy")
    assert healthy["tokens_equal"] and healthy["accepted_per_verify"] > 1.0
    assert healthy["modeled_speedup_inf2"] == modeled_speedup(healthy["accepted_per_verify"], 3, healthy["drafter_bytes_per_rank"],
                                                              healthy["target_weight_bytes_per_rank"])
    assert healthy["measured_speedup"] > 0  # the mirror drafter is the target's size: no speed-up is expected of it
    assert healthy["verify_ms"] > 0 and healthy["draft_step_ms"] > 0
    original = port_speculate.accepted_prefix
    monkeypatch.setattr(port_speculate, "accepted_prefix", lambda drafts, greedy: min(1, original(drafts, greedy)))
    capped = _bench(tmp_path, "capped")
    assert capped["tokens_equal"] and capped["accepted_per_verify"] <= 1.0
    assert capped["modeled_speedup_inf2"] < healthy["modeled_speedup_inf2"]


def test_perf_compare_flags_a_slower_speculative_decode():
    """Results benched with --speculate K carry speculative_ms_per_token[k=K] into perf compare,
    one sample per run; a 30% slower speculative decode is a regression, plain decode unchanged."""
    import random

    from harness import perf
    from tests.perf.test_perf_regression import samples, synthetic_result

    rng = random.Random(0)
    plain = samples(rng, 100, 0.02), samples(rng, 30, 0.02)
    base, cur = synthetic_result(*plain), synthetic_result(*plain)
    base["speculative"] = {"k": 3, "samples": [{"speculative_ms_per_token": v} for v in samples(rng, 20, 0.02)]}
    cur["speculative"] = {"k": 3, "samples": [{"speculative_ms_per_token": v} for v in samples(rng, 20, 0.02, scale=1.3)]}
    comp = perf.compare_results(base, cur, intervals=False)
    assert comp.regressions == ["speculative_ms_per_token[k=3]"]
    same = perf.compare_results(base, base, intervals=False)
    assert "speculative_ms_per_token[k=3]" in [m.metric for m in same.metrics] and not same.regressions
