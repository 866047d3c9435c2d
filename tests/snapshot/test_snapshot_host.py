"""Host-step and head snapshots (docs/snapshot.md): a check failure no layer point shows. The host
steps (harness/snapshot/host.py: the embedding lookup, the served probabilities, the reported
tokens) replay through the port's own host code on the recorded inputs; a head failure (the
logits) replays as its device call. Each reproduces with its fault planted, agrees without it, and
its repro exits 1; an exception inside the port is refused, naming where it was raised."""

from __future__ import annotations

import pytest

from harness.base.errors import OptionError
from harness.base.settings import RunSettings
from tests.faults.catalog import BY_NAME, TINY, engine_options
from tests.snapshot.support import planned_and_written, run_repro, snapshot_flow

SETTINGS = RunSettings(**engine_options(TINY))


def test_a_host_probability_fault_snapshots_replays_and_its_repro_exits_1(tiny0_ckpt, tiny0_reference, tmp_path):
    """host-probabilities-uncapped (the host serves softmax of the raw logits): the snapshot is the
    host step (the device's worst raw logits row -> the served distribution), replayed through
    Engine.probabilities to the check's own ratio with the fault planted and agreeing without it;
    the repro (harness unimportable) exits 1, its plain reading agreeing; the plan is what was written."""
    flow = snapshot_flow(BY_NAME["host-probabilities-uncapped"], tiny0_ckpt, tiny0_reference, SETTINGS,
                         tmp_path / "snap", tmp_path / "repro", fp32=False)
    target = flow.manifest["target"]
    assert target["host"] == "probabilities" and target["failing"] and target["graph_tag"] == "host_probabilities"
    failing = next(p for p in flow.result.probabilities if not p.passed)
    planted, clean = flow.replays[("cpu", "whole", True)], flow.replays[("cpu", "whole", False)]
    assert planted.reproduces and f"ratio {failing.ratio:.3g}" in planted.failure, planted.describe()
    assert not clean.reproduces, clean.describe()
    planned, written = planned_and_written(tmp_path / "snap", flow.manifest)
    assert abs(planned - written) <= 0.1 * written, (planned, written)
    done = run_repro(tmp_path / "repro", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "plain reading: agrees" in done.stdout and "port's recorded probabilities: FAILS" in done.stdout


@pytest.mark.slow  # five checks (~6 CPU-s each); sibling: test_a_host_probability_fault_snapshots_replays_and_its_repro_exits_1
@pytest.mark.parametrize("name,kind", [("embed-scale-not-cast", "embed"), ("decode-token-off-by-one", "tokens"),
                                       ("shared-softcap-formula-wrong", "probabilities"),
                                       ("host-softcap-without-divide", "probabilities"), ("softcap-twice", None)])
def test_each_host_side_fault_replays_and_its_repro_exits_1(name, kind, request, tmp_path):
    """Each catalog fault caught at no layer point: its host step (or, softcap-twice, its device
    call's logits) replays as reproduced with the fault planted and agreeing without it, and its
    repro exits 1."""
    from tests.snapshot.test_snapshot_catalog import FIXTURES

    fault = BY_NAME[name]
    ckpt_name, ref_name = FIXTURES[fault.checkpoint]
    ckpt, refs = request.getfixturevalue(ckpt_name), request.getfixturevalue(ref_name)
    settings = RunSettings(**engine_options(fault.checkpoint))
    flow = snapshot_flow(fault, ckpt, refs, settings, tmp_path / "snap", tmp_path / "repro")
    target = flow.manifest["target"]
    assert target.get("host") == kind and target["failing"], target
    if kind is None:
        assert target["point"] == "logits" and target["layer"] == ckpt.spec.num_layers - 1, target
    assert flow.replays[("cpu", "whole", True)].reproduces, flow.replays[("cpu", "whole", True)].describe()
    assert not flow.replays[("cpu", "whole", False)].reproduces, flow.replays[("cpu", "whole", False)].describe()
    done = run_repro(tmp_path / "repro", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr


def test_an_exception_inside_the_port_is_refused_naming_where(tiny0_ckpt, tiny0_reference, tmp_path):
    """decode-raises: no observation of the failing run, so nothing to replay against: --snapshot
    refuses before writing anything, naming the exception and its frame."""
    with pytest.raises(OptionError, match=r"exception inside the port \(IndexError at .*catalog\.py"):
        snapshot_flow(BY_NAME["decode-raises"], tiny0_ckpt, tiny0_reference, SETTINGS, tmp_path / "snap",
                      fp32=False, unplanted=False)
    assert not (tmp_path / "snap").exists()
