"""`gemma-parity reference` then `check --golden`: the main job end to end through the CLI, its
JSON contract, its report, and exit 1 when a port bug breaks parity."""

from __future__ import annotations

import json
import math

import pytest

from harness import model as port_model
from harness.cli import main
from tests.plot_extra import require_plot_extra


@pytest.fixture(scope="module")
def golden(tiny0_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "g"
    assert main(["reference", "--checkpoint", str(tiny0_dir), "--new-tokens", "4", "--out", str(out)]) == 0
    return out


def _check(tiny0_dir, golden, tmp_path):
    return main(["check", "--checkpoint", str(tiny0_dir), "--golden", str(golden),
                 "--json", str(tmp_path / "check.json"), "--report", str(tmp_path / "report")])


def test_check_with_golden_passes_and_writes_the_contract(tiny0_dir, golden, tmp_path, capsys):
    """A healthy port exits 0, prints SEQ_MATCH with both token sequences, and writes the JSON
    keys the issue promises plus a Markdown report and a plot."""
    assert _check(tiny0_dir, golden, tmp_path) == 0
    out = capsys.readouterr().out
    assert "SEQ_MATCH True" in out and "PARITY PASS" in out
    payload = json.loads((tmp_path / "check.json").read_text())
    assert payload["passed"] is True and payload["seq_match"] is True
    assert payload["first_divergent_layer"] is None
    manifest = json.loads((golden / "manifest.json").read_text())
    for prompt, generated in zip(payload["prompts"], manifest["results"]["float32"]):
        assert prompt["reference_tokens"] == generated["generated"]
        assert prompt["device_tokens"] == prompt["reference_tokens"] and prompt["first_mismatch"] is None
    assert [layer["index"] for layer in payload["layers"]] == list(range(12))
    for layer in payload["layers"]:
        assert layer["type"] in ("sliding_attention", "full_attention") and layer["pass"] is True
        assert 0 < layer["rel_l2"] < 0.1 and 0.99 < layer["cosine"] <= 1 and math.isfinite(layer["max_abs"])
    report = tmp_path / "report"
    assert "first divergent layer: **none**" in (report / "check.md").read_text()
    assert {"check.md", "check.json"} <= {p.name for p in report.iterdir()}
    require_plot_extra()
    assert {p.name for p in report.iterdir()} == {"check.md", "check.json", "check_errors.png"}


def test_check_fails_with_exit_1_on_a_port_bug(tiny0_dir, golden, tmp_path, monkeypatch, capsys):
    """A 1/sqrt(head_dim) attention scale in the port: exit 1, PARITY FAIL, layer 0 first."""
    monkeypatch.setattr(port_model, "attention_scale", lambda head_dim: head_dim ** -0.5)
    assert _check(tiny0_dir, golden, tmp_path) == 1
    assert "PARITY FAIL" in capsys.readouterr().out
    payload = json.loads((tmp_path / "check.json").read_text())
    assert payload["passed"] is False and payload["first_divergent_layer"] == 0
    assert payload["layers"][0]["pass"] is False and payload["layers"][0]["component"] == "attention"
