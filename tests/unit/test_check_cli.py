"""`gemma-parity reference` then `check --golden`: the main job end to end through the CLI, its
JSON contract, its report, and exit 1 when a port bug breaks parity."""

from __future__ import annotations

import json
import math

import pytest

from harness.cli import main
from harness.port import model as port_model
from tests.plot_extra import require_plot_extra


@pytest.fixture(scope="module")
def golden(tiny0_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "g"
    assert main(["reference", "--checkpoint", str(tiny0_dir), "--new-tokens", "4", "--out", str(out)]) == 0
    return out


def test_a_reference_golden_carries_the_provenance_block_of_results(golden, tiny0_dir):
    """The same block as check's and bench's results: the command's settings, the checkpoint's hashes,
    package versions, the commit and the dirty flag, under the golden's hash."""
    import torch

    from harness.inputs.checkpoint import Checkpoint

    manifest = json.loads((golden / "manifest.json").read_text())
    prov = manifest["provenance"]
    assert set(prov) == {"settings", "inputs", "packages", "git"}
    assert prov["settings"]["new_tokens"] == 4 and prov["settings"]["command"] == "reference"
    assert prov["inputs"]["checkpoint"] == Checkpoint.open(tiny0_dir).file_hashes() == manifest["checkpoint"]["files"]
    assert prov["packages"]["torch"] == torch.__version__ and "transformers" in prov["packages"]
    assert prov["git"] == _expected_git_state()


def _expected_git_state() -> dict:
    """What the tree is, found here independently of provenance.py: in a git checkout its HEAD (40 hex)
    and a clean/dirty flag; outside one (a source archive) no commit ("unknown", or $GITHUB_SHA) and
    no flag."""
    import os
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        commit = head.stdout.strip()
        assert re.fullmatch(r"[0-9a-f]{40}", commit)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True)
        return {"commit": commit, "dirty": bool(status.stdout.strip())}
    return {"commit": os.environ.get("GITHUB_SHA", "unknown"), "dirty": None}


def _check(tiny0_dir, golden, tmp_path, batch_stage: bool = False, verbose: bool = False):
    # --batch 1 unless asked: the other tests here are about the stages and the report; the contract
    # test runs the default check whole, its batch stage included
    return main(["check", "--checkpoint", str(tiny0_dir), "--golden", str(golden),
                 *([] if batch_stage else ["--batch", "1"]), *(["--verbose"] if verbose else []),
                 "--json", str(tmp_path / "check.json"), "--report", str(tmp_path / "report")])


def _every_stage_is_timed(out: str, payload: dict) -> None:
    """--verbose: each extra stage that ran has its time, and the lines add up to the run's total
    (what no line accounts for is printed, and small)."""
    import re

    times = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("time, ")}
    seconds = payload["seconds"]
    assert set(payload["extra_stages"]) <= set(seconds["stages"]), (payload["extra_stages"].keys(), seconds)
    for stage in seconds["stages"]:
        assert f" {stage} " in times["time, stages"]
    rest = float(re.search(r"rest of the run: (-?[\d.]+) s", times["time, rest of the run"]).group(1))
    total = seconds["run"]["total"]
    assert -0.5 < rest < 0.1 * total + 1.0, (rest, total, times)  # every stage of the run is in a line above
    command = float(re.search(r"time, command: ([\d.]+) s", times["time, command"]).group(1))
    assert command >= total - 0.1 and "before the run" in times["time, command"]


def test_check_with_golden_passes_and_writes_the_contract(tiny0_dir, golden, tmp_path, capsys):
    """A healthy port exits 0, prints SEQ_MATCH with both token sequences, and writes the JSON
    keys the issue promises plus a Markdown report and a plot."""
    assert _check(tiny0_dir, golden, tmp_path, batch_stage=True, verbose=True) == 0
    out = capsys.readouterr().out
    assert "SEQ_MATCH True" in out and "PARITY PASS" in out
    _every_stage_is_timed(out, json.loads((tmp_path / "check.json").read_text()))
    # where the files went, then the main layer table (with the fp32 stage's column) before the served
    # build's verdict, and the verdict last
    lines = out.splitlines()
    assert f"report written to {tmp_path / 'report'}" in lines and f"json written to {tmp_path / 'check.json'}" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("layer  type"))
    served = next(i for i, line in enumerate(lines) if line.startswith("served build"))
    assert "fp32 ratio" in lines[header] and header < served < lines.index("PARITY PASS")
    payload = json.loads((tmp_path / "check.json").read_text())
    assert payload["passed"] is True and payload["seq_match"] is True
    assert payload["first_divergent_layer"] is None
    batch = payload["extra_stages"]["batch"]  # no --batch: the prompts also ran as one ragged batch
    assert batch["ran"] and batch["passed"] and batch["slots"] == 4 and len(batch["prompts"]) == len(payload["prompts"])
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
    assert {p.name for p in report.iterdir()} == {"check.md", "check.json", "check_errors.png",
                                                  ".gemma-parity-manifest.json"}  # harness/base/owned_dir.py


@pytest.mark.slow  # about 11 CPU-seconds; exit 1 through the CLI stays in the default lane (the exact GELU below)
def test_check_fails_with_exit_1_on_a_port_bug(tiny0_dir, golden, tmp_path, monkeypatch, capsys):
    """A 1/sqrt(head_dim) attention scale in the port: exit 1, PARITY FAIL, layer 0 first."""
    monkeypatch.setattr(port_model, "attention_scale", lambda head_dim: head_dim ** -0.5)
    assert _check(tiny0_dir, golden, tmp_path) == 1
    out = capsys.readouterr().out
    assert "PARITY FAIL" in out
    payload = json.loads((tmp_path / "check.json").read_text())
    assert payload["passed"] is False and payload["first_divergent_layer"] == 0
    assert payload["layers"][0]["pass"] is False and payload["layers"][0]["component"] == "attention"
    # bounded output: the first 5 flips listed, the rest counted (all in the JSON)
    flips = sum(len(p[part]["mismatches"]) for p in payload["prompts"]
                for part in ("prefill_logits", "decode_logits_teacher_forced"))
    listed = [line for line in out.splitlines() if " -> near_tie: " in line or " -> divergence: " in line]
    assert flips > 5 and len(listed) == 5
    assert f"... {flips - 5} more token flips not listed" in out
    # the Markdown names the failed stage(s) and the first failure point
    markdown = (tmp_path / "report" / "check.md").read_text()
    first = payload["first_failure"]
    assert f"- failed stage: **{', '.join(payload['failed_stages'])}**" in markdown
    assert f"- first failure: **{first['stage']} stage, `{first['point']}`**" in markdown


def test_check_names_stage_and_point_of_a_sub_envelope_bug(tiny0_dir, golden, tmp_path, monkeypatch, capsys):
    """The exact GELU (every point within ~1.3x the bf16 envelope): exit 1, the fp32 stage fails at
    layer 0's MLP residual, the bf16 stage passes, the bit-exact layer stage departs there too (a
    computation other than the model's), and the JSON says which stages failed."""
    from tests.faults.catalog import exact_gelu

    exact_gelu(monkeypatch)
    assert _check(tiny0_dir, golden, tmp_path) == 1
    out = capsys.readouterr().out
    assert "PARITY FAIL (stage fp32, bitwise_layers)" in out and "FAIL layers.0.mlp_residual" in out
    # the layer table shows where: layer 0's row fails in its fp32 column (bf16 passes it)
    row0 = next(line for line in out.splitlines() if line.startswith("0 "))
    assert row0.rstrip().endswith("FAIL fp32 (layers.0.mlp_residual)"), row0
    payload = json.loads((tmp_path / "check.json").read_text())
    layer0 = payload["layers"][0]
    assert layer0["pass"] is True and layer0["fp32_pass"] is False and layer0["fp32_ratio"] > 8
    assert "FAIL fp32 (layers.0.mlp_residual)" in (tmp_path / "report" / "check.md").read_text()
    assert payload["failed_stages"] == ["fp32", "bitwise_layers"] and payload["stages"]["bf16"]["passed"] is True
    assert payload["extra_stages"]["bitwise_layers"]["failures"][0]["point"] == "layers.0.mlp_residual"
    assert payload["first_failure"]["stage"] == "fp32"
    assert payload["first_failure"]["point"] == "layers.0.mlp_residual"


def test_an_exception_inside_the_port_is_a_parity_failure(tiny0_dir, golden, tmp_path, monkeypatch, capsys):
    """A port bug that raises in decode is exit 1 (not 2, bad input), naming where it was raised."""
    from harness.port import engine as port_engine

    def decode_rows(self, tokens, positions, seq_ids, capture=False):  # the decode call the loop makes
        raise IndexError(f"cache slot {positions[0]} out of range")

    monkeypatch.setattr(port_engine.Engine, "decode_rows", decode_rows)
    assert _check(tiny0_dir, golden, tmp_path) == 1
    out = capsys.readouterr().out
    assert "exception inside the port" in out and "IndexError" in out
    payload = json.loads((tmp_path / "check.json").read_text())
    error = payload["port_error"]
    assert error["type"] == "IndexError" and "test_check_cli.py" in error["where"]
    assert "in decode_rows" in error["where"] and "harness/port/decode.py" in error["where"]  # the one decode loop
    assert payload["failed_stages"] == ["fp32", "bf16"]


def test_a_prompt_longer_than_the_kv_length_is_still_bad_input(tiny0_dir, tmp_path, capsys):
    """Bad input is told apart before the port runs: exit 2. (A prompt longer than the largest
    bucket is prefilled in chunks; one that with its new tokens overflows the KV length is refused.)"""
    prompts = tmp_path / "long.json"
    prompts.write_text(json.dumps([list(range(3, 103))]))
    assert main(["check", "--checkpoint", str(tiny0_dir), "--prompts", str(prompts), "--buckets", "64",
                 "--kv-len", "100", "--new-tokens", "4"]) == 2
    assert "kv-len" in capsys.readouterr().err
