"""Snapshot, replay and standalone repro on the tiny 12B at TP 2 on cpu (docs/snapshot.md): one
representative catalog fault end to end, the clean control, and what replay names. The whole
catalog, the family variants and TP 1 run in the slow lane (tests/snapshot/test_snapshot_catalog.py)."""

from __future__ import annotations

from harness.base.settings import RunSettings
from harness.snapshot.replay import BackendReplay, whose
from harness.judge.verdicts import PointResult
from tests.faults.catalog import BY_NAME, engine_options, TINY
from tests.snapshot.support import planned_and_written, run_repro, snapshot_flow

SETTINGS = RunSettings(**engine_options(TINY))


def test_a_planted_fault_snapshots_replays_and_its_repro_exits_1(tiny0_ckpt, tiny0_reference, tmp_path):
    """rope-interleaved-pairs (trap 4, layer 0's attention): the snapshot's call replays to the
    check's own ratio with the fault planted, whole and layer alone (and at TP 1 too), and agrees
    with it removed;
    the repro script, with harness unimportable, shows the port's layer failing beside a plain
    reading that agrees, and exits 1. The plan line's size is what was written, within 10%."""
    fault = BY_NAME["rope-interleaved-pairs"]
    flow = snapshot_flow(fault, tiny0_ckpt, tiny0_reference, SETTINGS, tmp_path / "snap", tmp_path / "repro",
                         modes=("whole", "layer"), fp32=False, other_tp=1)  # the bf16 stage catches it
    target = flow.manifest["target"]
    assert target["failing"] and target["layer"] == 0 and target["point"] == "layers.0.attn_residual"
    whole, layer = flow.replays[("cpu", "whole", True)], flow.replays[("cpu", "layer", True)]
    assert whole.reproduces and layer.reproduces and flow.replays[("cpu-tp1", "whole", True)].reproduces
    replayed = next(p for p in whole.points if p.name == target["point"])
    assert abs(replayed.required_factor - target["ratio"]) <= 1e-6 * target["ratio"]
    assert not flow.replays[("cpu", "whole", False)].reproduces, "the clean port agrees on the same call"
    planned, written = planned_and_written(tmp_path / "snap", flow.manifest)
    assert abs(planned - written) <= 0.1 * written, (planned, written)
    assert flow.lines[0].startswith("snapshot plan:")
    done = run_repro(tmp_path / "repro", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "plain reading: agrees" in done.stdout and "port's traced layer (TP 2): FAILS" in done.stdout


def _replay(backend: str, ratio: float) -> BackendReplay:
    point = PointResult("layers.3.output", 0.1, 0.9, 0.1, 0.01, ratio, ratio, 0, True, ratio <= 4.0)
    return BackendReplay(backend, 2, "whole", [point])


def test_replay_names_whose_failure_it_is():
    """Shown by every backend: the port's; by neuron and not cpu: neuron's compilation or runtime
    divergence; by none: not reproduced (the default-lane sibling of the double's one-backend fault
    in test_snapshot_catalog.py)."""
    snap = type("S", (), {"target": {"failing": True}})()
    assert "the port's own" in whose(snap, [_replay("cpu", 20), _replay("xla", 20)])
    named = whose(snap, [_replay("cpu", 1), _replay("neuron", 20)])
    assert "compilation or runtime divergence of neuron" in named and "not on cpu" in named
    assert whose(snap, [_replay("cpu", 1)]).startswith("no backend run")
