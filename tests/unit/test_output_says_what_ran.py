"""Outputs that say what the run did (issue 49): SEQ_MATCH explained where it is printed, --verbose
accounting for the whole run, no local-ratio column for layers that never ran alone, `info` naming
the model it plans, and the README's `info --batch` row naming the 12B."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from harness.cli import main
from harness.judge.compare import compare_point
from harness.judge.layers import LayerVerdict
from harness.judge.results import ParityStage
from harness.report.formats import seq_match_line
from harness.report.seconds import seconds_lines

ROOT = Path(__file__).resolve().parents[2]


def _payload(seq, passed, prompts):
    return {"seq_match": seq, "passed": passed, "prompts": [{"seq_match": s} for s in prompts]}


def test_seq_match_says_what_it_means_beside_the_verdict():
    assert seq_match_line(_payload(True, True, [True, True])).startswith("SEQ_MATCH True (every prompt's greedy")
    tie = seq_match_line(_payload(False, True, [True, False, False]))
    assert tie.startswith("SEQ_MATCH False (the greedy tokens departed from the reference's in prompts 1, 2;")
    assert "near or saturation tie" in tie and "parity allows" in tie  # above PARITY PASS (--quantize int8's case)
    fail = seq_match_line(_payload(False, False, [False]))
    assert "in prompt 0;" in fail and "fails the check" in fail
    assert seq_match_line(_payload(None, True, [])) == "SEQ_MATCH None"  # bisect's truncate mode: no decode


def test_verbose_accounts_for_the_whole_run():
    seconds = {"run": {"build": 2.0, "reference": 10.0, "total": 60.0, "before": 5.0, "command": 66.5},
               "fp32": {"port": 10.0, "judge": 1.0}, "bf16": {"port": 12.0, "local": 5.0},
               "stages": {"bitwise_layers": 8.0, "batch": 6.0, "served": 4.0}}
    lines = seconds_lines(seconds)
    assert "time, stages: bitwise_layers 8.0 s, batch 6.0 s, served 4.0 s" in lines
    assert "time, rest of the run: 2.0 s (its total less every line above)" in lines  # 60 - 58
    [command] = [line for line in lines if line.startswith("time, command")]
    assert "66.5 s" in command and "5.0 s before the run" in command and "1.5 s writing the outputs" in command
    assert not any("before" in line for line in lines if line.startswith("time, run"))


def _point(name, error):
    ref = torch.ones(4, 8)
    return compare_point(name, ref + error, ref, ref + 0.01)


def test_a_layer_that_never_ran_alone_has_no_local_ratio(monkeypatch):
    """tiny-e2b: every layer reads a per-layer input, so none runs alone; the local column stayed
    filled with the cumulative ratio while the distribution said no local verdicts ran."""
    from harness.parity import check

    shared = LayerVerdict(0, "sliding_attention", [_point("layers.0.output", 0.01)])  # cumulative only
    alone = LayerVerdict(1, "sliding_attention", [_point("layers.1.output", 0.01)],
                         local=[_point("layers.1.output", 0.02)])
    monkeypatch.setattr(check, "local_verdicts", lambda *a, **k: ([shared, alone], None))
    monkeypatch.setattr(check, "ReferenceLayers", lambda checkpoint: None)  # no checkpoint: the runs are stand-ins
    result = ParityStage(backend="cpu", tp=2, dtype="bfloat16", stage="bf16")
    check._local(result, checkpoint=None, layer_backend=None, progress=False)
    assert [v.index for v in result.local] == [1]
    assert result.local[0].ratio == max(p.required_factor for p in alone.local)
    none_alone = ParityStage(backend="cpu", tp=2, dtype="bfloat16", stage="bf16")
    monkeypatch.setattr(check, "local_verdicts", lambda *a, **k: ([shared], None))
    check._local(none_alone, checkpoint=None, layer_backend=None, progress=False)
    assert none_alone.local == []  # the local verdicts ran (not None: the bit-exact layers still run)
    from harness.judge.distribution import judge_distribution

    [note] = judge_distribution(none_alone).notes
    assert note.startswith("no layer of this model runs alone")


def test_info_names_the_model_it_plans(capsys):
    assert main(["info", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("planning the embedded tiny model")
    assert "--config fixtures/configs/gemma-4-12b-it.json" in out.splitlines()[0]


def test_the_readme_batch_row_plans_the_12b(capsys):
    readme = (ROOT / "README.md").read_text()
    [command] = re.findall(r"`gemma-parity (info [^`]*--batch 8[^`]*)`", readme)
    assert "--config fixtures/configs/gemma-4-12b-it.json" in command
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(command.split()) == 0
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    from harness.inputs.spec import load_spec

    twelve_b = load_spec(ROOT / "fixtures" / "configs" / "gemma-4-12b-it.json").spec_hash()
    assert f"spec {twelve_b} from " in out and "planning the embedded tiny model" not in out
