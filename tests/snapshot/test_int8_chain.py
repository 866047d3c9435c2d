"""An int8 port's failure travels through the snapshot chain (docs/snapshot.md, docs/quantization.md):
with a quantization fault planted, the snapshot records `--quantize`, `replay` rebuilds the int8
port (in process and through the command, from the user's own checkpoint) and reproduces, the
clean int8 port agrees; the repro traces the quantized layer (int8 codes and scales in its traced
graph, not the dequantized copy's weights) and exits 1, the clean port's repro exits 0."""

from __future__ import annotations

import json

import pytest

from harness.base.settings import RunSettings
from harness.cli import main
from tests.faults.quant_catalog import BY_NAME
from tests.quant.conftest import QUICK, int8_ckpt, int8_reference  # noqa: F401 (fixtures)
from tests.snapshot.support import run_repro, snapshot_flow

SETTINGS = RunSettings(tp=1, quantize="int8", **QUICK)


@pytest.fixture(scope="module")
def zero_point_flow(tmp_path_factory, int8_ckpt, int8_reference):  # noqa: F811
    tmp = tmp_path_factory.mktemp("int8-chain")
    flow = snapshot_flow(BY_NAME["zero-point"], int8_ckpt, int8_reference, SETTINGS, tmp / "snap", tmp / "repro")
    return tmp, flow


def test_an_int8_fault_reproduces_through_replay_and_repro(zero_point_flow, int8_ckpt, tmp_path):  # noqa: F811
    tmp, flow = zero_point_flow
    assert not flow.result.passed and flow.manifest["target"]["failing"]
    settings = flow.manifest["settings"]
    assert settings["quantize"] == "int8", settings
    # the snapshot names the user's checkpoint (the quantized copy is the tool's, rebuilt from it)
    assert flow.manifest["checkpoint"]["path"] == str(int8_ckpt.unquantized.path)
    assert any(k.endswith(".scale") for k in json.loads((tmp / "snap" / "snapshot.json").read_text())["tensors"])
    assert flow.replays[("cpu", "whole", True)].reproduces, "the planted int8 fault replays"
    assert not flow.replays[("cpu", "whole", False)].reproduces, "the clean int8 port agrees"
    done = run_repro(tmp / "repro", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "plain reading: agrees" in done.stdout and "FAILS" in done.stdout
    meta_settings = json.loads(_repro_meta(tmp / "repro"))["settings"]
    assert meta_settings["quantize"] == "int8"


def _repro_meta(repro) -> str:
    from safetensors import safe_open

    with safe_open(str(repro / "repro.safetensors"), "pt") as f:
        return f.metadata()["repro"]


def test_the_replay_command_rebuilds_the_int8_port(zero_point_flow, monkeypatch, capsys):
    """`replay DIR` from the snapshot alone: the int8 port, built from the checkpoint it records,
    reproduces the planted fault (exit 1) and agrees without it (exit 0)."""
    tmp, _ = zero_point_flow
    assert main(["replay", str(tmp / "snap")]) == 0
    assert "agrees" in capsys.readouterr().out
    BY_NAME["zero-point"].inject(monkeypatch)
    assert main(["replay", str(tmp / "snap")]) == 1
    assert "REPRODUCES" in capsys.readouterr().out


@pytest.mark.slow  # a second whole chain; the planted one above runs in the default lane
def test_the_clean_int8_ports_repro_exits_0(tmp_path, int8_ckpt, int8_reference):  # noqa: F811
    """Control: the same chain with no fault planted; its repro agrees (exit 0)."""
    flow = snapshot_flow(None, int8_ckpt, int8_reference, SETTINGS, tmp_path / "snap", tmp_path / "repro",
                         unplanted=False)
    assert not flow.replays[("cpu", "whole", True)].reproduces
    done = run_repro(tmp_path / "repro", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
