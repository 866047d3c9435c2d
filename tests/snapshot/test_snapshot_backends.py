"""Snapshot, replay and repro of a control call recorded on each backend (no check: a control
target on the references, tests/snapshot/support.py `control_target`), for the tiny 12B and the
family variants at TP 1 and 2: recorded through the NxD double (the neuron backend's own code,
traced and "compiled" by tests/nxd_double), replayed on neuron and cpu to agreement, the plan
within 10% of what is written, the repro (traced from the port's cpu layer, fed the neuron engine's
calls) exiting 0; the MoE variant's from its check (clean and with a routing fault planted). The
xla backend's: tests/xla/test_snapshot_xla.py; the fault side (every catalog
fault, a neuron-only fault): tests/snapshot/test_snapshot_catalog.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.base.settings import RunSettings
from tests.snapshot.support import control_target, observation, planned_and_written, run_repro, through_the_double

# model, TP, layer, decode step. No MoE control here: on references alone (no check) the port's routing
# is not followed, so a flipped near-tie expert moves the final norm; the MoE variant's snapshots are
# the check's (moe_flow below, through the double and on xla; on cpu test_snapshot_catalog.py's family test).
# Every dense model at TP 1 and 2, prefill and decode-step calls, a KV-shared layer among them (~7 CPU-s a case).
CASES = [("tiny", 1, 5, None), ("tiny", 2, 3, 0), ("e2b", 1, 2, None), ("e2b", 2, 6, 1), ("e4b", 1, 3, None),
         ("e4b", 2, 8, 0), ("31b", 1, 1, 1), ("31b", 2, 4, None)]


def model(name: str, request):
    from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_KV_LEN
    from tests.family.shared import family_checkpoint, family_reference

    if name == "tiny":
        return request.getfixturevalue("tiny0_ckpt"), request.getfixturevalue("tiny0_reference"), ((64, 256), 288)
    return family_checkpoint(name), family_reference(name), (FAMILY_BUCKETS, FAMILY_KV_LEN)


def record_replay_repro(ckpt, refs, settings, target, tmp_path):
    """Snapshot `target` recorded on settings.backend, its replays there and on cpu, its repro's run."""
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.record import record_call
    from harness.snapshot.replay import replay
    from harness.snapshot.repro import write_repro
    from harness.snapshot.write import write_snapshot

    obs = observation(refs)
    manifest = write_snapshot(tmp_path / "snap", ckpt, settings, target, record_call(ckpt, settings, target, obs),
                              source="test", say=lambda line: None)
    snap = read_snapshot(tmp_path / "snap")
    replays = [replay(snap, ckpt, name) for name in (settings.backend, "cpu")]
    write_repro(ckpt, settings, target, obs, tmp_path / "repro", say=lambda line: None)
    return manifest, replays, run_repro(tmp_path / "repro", tmp_path)


@pytest.mark.slow  # traces and "compiles" every graph through the NxD double, ~7 CPU-s a case; sibling: test_a_planted_fault_snapshots_replays_and_its_repro_exits_1
@pytest.mark.parametrize("name,tp,layer,step", CASES)
def test_a_control_recorded_through_the_nxd_double_replays_and_repros_clean(name, tp, layer, step, request, tmp_path):
    ckpt, refs, (buckets, kv_len) = model(name, request)
    settings = RunSettings(backend="neuron", tp=tp, buckets=buckets, kv_len=kv_len)
    target = control_target(refs, settings, layer=layer, prompt=1, step=step)
    with pytest.MonkeyPatch.context() as mp, through_the_double(mp, tmp_path):
        manifest, replays, done = record_replay_repro(ckpt, refs, settings, target, tmp_path)
    assert manifest["settings"]["backend"] == "neuron" and manifest["target"]["graph_tag"] == target.graph_tag
    assert [r.backend for r in replays] == ["neuron", "cpu"] and not any(r.reproduces for r in replays), \
        [r.describe() for r in replays]
    planned, written = planned_and_written(tmp_path / "snap", manifest)
    assert abs(planned - written) <= 0.1 * written, (planned, written)
    assert done.returncode == 0 and f"at TP {tp}" in done.stdout, done.stdout + done.stderr


def moe_flow(settings, tmp_path, fault=None):
    """The 26B-A4B variant checked on `settings` (fault planted where given, the check's bf16 stage:
    its references follow the port's routing), snapshotted and repro'd, replayed on its backend and
    on cpu with the fault still planted: (target, replays, the repro's run)."""
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.replay import replay
    from harness.snapshot.repro import emit_repro
    from harness.snapshot.write import snapshot_check
    from tests.family.shared import family_checkpoint, family_reference
    from tests.snapshot.support import run_check

    ckpt, refs = family_checkpoint("26b-a4b"), family_reference("26b-a4b")
    with pytest.MonkeyPatch.context() as mp:
        if fault is not None:
            fault.inject(mp)
        result = run_check(ckpt, refs, settings, fp32=False)
        manifest = snapshot_check(result, ckpt, settings, tmp_path / "snap", source="check", say=lambda line: None)
        emit_repro(result, ckpt, settings, tmp_path / "repro", say=lambda line: None)
        snap = read_snapshot(tmp_path / "snap")
        replays = [replay(snap, ckpt, name) for name in dict.fromkeys((settings.backend, "cpu"))]
    planned, written = planned_and_written(tmp_path / "snap", manifest)
    assert abs(planned - written) <= 0.1 * written, (planned, written)
    return manifest["target"], replays, run_repro(tmp_path / "repro", tmp_path)


@pytest.mark.slow  # two MoE checks through the NxD double, ~30 CPU-s a TP degree; sibling: test_a_planted_fault_snapshots_replays_and_its_repro_exits_1
@pytest.mark.parametrize("tp", [1, 2])
def test_the_moe_variant_through_the_nxd_double_snapshots_replays_and_repros(tp, tmp_path):
    """The 26B-A4B variant on neuron (the NxD double) at TP 1 and 2: the clean check's control
    snapshot replays to agreement on neuron and cpu and its repro exits 0; with topk-not-renormalised
    planted the check's snapshot reproduces on both (the port's own) and its repro exits 1."""
    from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_KV_LEN

    settings = RunSettings(backend="neuron", tp=tp, buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN)
    with pytest.MonkeyPatch.context() as mp, through_the_double(mp, tmp_path):
        moe_clean_and_planted(settings, tmp_path)


def moe_clean_and_planted(settings, tmp_path) -> None:
    """The MoE variant's clean control and topk-not-renormalised planted, on settings.backend and cpu
    (moe_flow): the control agrees on its backend and on cpu (where cpu routes otherwise than the
    recorded call at a near tie, the stored references follow the recorded routing: the replay names
    it and judges what that routing cannot move, as the repro does), and its repro exits 0; the fault reproduces on both (the port's own) and its repro
    exits 1."""
    from harness.snapshot.replay import whose
    from tests.faults.catalog import FAMILY_CATALOG

    fault = next(f for f in FAMILY_CATALOG if f.name == "topk-not-renormalised")
    target, replays, done = moe_flow(settings, tmp_path / "clean")
    assert not target["failing"] and [r.backend for r in replays] == [settings.backend, "cpu"], target
    own, cpu = replays
    assert not own.reproduces and not own.rerouted, own.describe()
    assert not cpu.reproduces and (not cpu.rerouted or "routes otherwise" in cpu.describe()), cpu.describe()
    assert "compilation or runtime divergence" not in whose(SimpleNamespace(target=target), replays)
    assert done.returncode == 0 and f"at TP {settings.tp}" in done.stdout, done.stdout + done.stderr
    target, replays, done = moe_flow(settings, tmp_path / "fault", fault)
    assert target["failing"] and all(r.reproduces for r in replays), [r.describe() for r in replays]
    assert done.returncode == 1, done.stdout + done.stderr
