"""The failure to look at (docs/snapshot.md#a-failure-to-look-at): `--demo-fault rope-pairs` plants a
known port bug, plainly labelled, that travels into the snapshot (the replay plants it again, with
nothing planted by the caller) and into the repro's traced layer; it is refused where it cannot
run, and a command's planted bug ends with the command."""

from __future__ import annotations

import json

import pytest

from harness.base.settings import RunSettings
from harness.cli import main
from harness.port import model as port_model
from harness.port.demo_fault import banner, planted
from tests.faults.catalog import TINY, engine_options
from tests.snapshot.support import run_check, run_repro

SETTINGS = RunSettings(**engine_options(TINY))


def test_the_demo_fault_travels_into_snapshot_replay_and_repro(tiny0_ckpt, tiny0_reference, tmp_path):
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.replay import replay
    from harness.snapshot.repro import emit_repro
    from harness.snapshot.write import snapshot_check

    settings = SETTINGS.but(demo_fault="rope-pairs")
    clean_rotate = port_model.rotate_half
    with planted("rope-pairs"):
        result = run_check(tiny0_ckpt, tiny0_reference, settings, fp32=False)
        manifest = snapshot_check(result, tiny0_ckpt, settings, tmp_path / "snap", source="check", say=lambda l: None)
        emit_repro(result, tiny0_ckpt, settings, tmp_path / "rep", say=lambda l: None)
    assert port_model.rotate_half is clean_rotate, "the fault is removed after its block"
    assert not result.passed and manifest["settings"]["demo_fault"] == "rope-pairs"
    snap = read_snapshot(tmp_path / "snap")
    assert replay(snap, tiny0_ckpt, "cpu").reproduces, "the replay plants the recorded demo fault itself"
    snap.manifest["settings"]["demo_fault"] = None  # the same call without it: the port agrees
    assert not replay(snap, tiny0_ckpt, "cpu").reproduces
    done = run_repro(tmp_path / "rep", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == banner("rope-pairs")


@pytest.mark.parametrize("argv, fragment", [
    (["--demo-fault", "nonsense"], "--demo-fault 'nonsense': use one of rope-pairs"),
    (["--demo-fault", "rope-pairs", "--backend", "xla"], "runs on the cpu backend"),
])
def test_a_demo_fault_is_refused_where_it_cannot_run(argv, fragment, monkeypatch, capsys):
    monkeypatch.setattr("harness.backends.build_engine", lambda *a, **k: (_ for _ in ()).throw(AssertionError()))
    monkeypatch.setattr("harness.backends.backend_unavailable", lambda name: None)
    assert main(["check", "--model", "tiny", *argv]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow  # the whole CLI chain (check, replay, reference, bisect, repro): about a minute of CPU
def test_the_documented_walkthrough_exits_1_at_every_step(tmp_path, capsys):
    clean_rotate = port_model.rotate_half
    assert main(["check", "--model", "tiny", "--demo-fault", "rope-pairs", "--snapshot", str(tmp_path / "snap"),
                 "--json", str(tmp_path / "c.json")]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == lines[-1] == banner("rope-pairs")
    assert port_model.rotate_half is clean_rotate, "the command's planted bug ended with it"
    assert json.loads((tmp_path / "c.json").read_text())["demo_fault"]["name"] == "rope-pairs"
    assert main(["replay", str(tmp_path / "snap")]) == 1
    out = capsys.readouterr().out
    assert out.startswith(banner("rope-pairs")) and "REPRODUCES" in out
    assert main(["reference", "--model", "tiny", "--out", str(tmp_path / "gold")]) == 0
    assert main(["bisect", "--model", "tiny", "--golden", str(tmp_path / "gold"), "--demo-fault", "rope-pairs",
                 "--emit-repro", str(tmp_path / "rep")]) == 1
    capsys.readouterr()
    done = run_repro(tmp_path / "rep", tmp_path)
    assert done.returncode == 1 and done.stdout.startswith(banner("rope-pairs")), done.stdout + done.stderr
