"""Snapshots on the xla backend (docs/snapshot.md): a clean run's control snapshot, recorded on
xla, replays to agreement on cpu and xla; a fault planted only in the xla backend's in-graph
collectives (its all-reduce returning each rank's own partial times TP instead of the sum, as a
miscompiled reduction might; a uniform scale would vanish in the post-norms) fails the check on
xla, and its snapshot replays as reproduced on xla and agreeing on cpu: xla's divergence alone."""

from __future__ import annotations

import pytest

from harness.base.settings import RunSettings
from tests.snapshot.support import run_check

pytestmark = pytest.mark.xla
SETTINGS = RunSettings(backend="xla", tp=2, buckets=(64, 256), kv_len=288)


def _snapshot_and_replay(result, ckpt, out):
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.replay import replay
    from harness.snapshot.write import snapshot_check

    snapshot_check(result, ckpt, SETTINGS, out, source="check", say=lambda line: None)
    snap = read_snapshot(out)
    return snap, [replay(snap, ckpt, name) for name in ("cpu", "xla")]


def test_xla_control_agrees_and_an_xla_only_fault_is_xlas(tiny0_ckpt, tiny0_reference, tmp_path, monkeypatch):
    from harness.backends import xla
    from harness.snapshot.replay import whose

    clean = run_check(tiny0_ckpt, tiny0_reference, SETTINGS, fp32=False)
    assert clean.passed, clean.failures()
    snap, replays = _snapshot_and_replay(clean, tiny0_ckpt, tmp_path / "clean")
    assert not snap.target["failing"] and [r.reproduces for r in replays] == [False, False]

    monkeypatch.setattr(xla.XlaCollectives, "all_reduce", lambda self, x: (x.float() * self.tp).to(x.dtype))
    faulty = run_check(tiny0_ckpt, tiny0_reference, SETTINGS, fp32=False)
    assert not faulty.passed
    snap, replays = _snapshot_and_replay(faulty, tiny0_ckpt, tmp_path / "fault")
    assert snap.target["failing"] and [r.reproduces for r in replays] == [False, True]
    assert "compilation or runtime divergence of xla" in whose(snap, replays)
