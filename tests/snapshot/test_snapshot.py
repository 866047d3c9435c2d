"""Snapshot, replay and standalone repro on the tiny 12B at TP 2 on cpu (docs/snapshot.md): one
representative catalog fault end to end, the clean control, and what replay names. The whole
catalog, the family variants and TP 1 run in the slow lane (tests/snapshot/test_snapshot_catalog.py)."""

from __future__ import annotations

import json
import re

import pytest

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
    reading that agrees, and exits 1, on the CPU and through --neuron's torch_neuronx.trace (a
    stand-in: no device here); without torch-neuronx or with bad arguments it exits 2 before any
    work. Both plan lines' sizes are what was written, within 10%."""
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
    repro_plan = next(line for line in flow.lines if line.startswith("repro plan:"))
    planned_repro = float(re.search(r"([0-9.]+) MiB", repro_plan).group(1)) * 2**20
    written_repro = sum(p.stat().st_size for p in (tmp_path / "repro").iterdir())
    assert abs(planned_repro - written_repro) <= 0.1 * written_repro, (repro_plan, written_repro)
    done = run_repro(tmp_path / "repro", tmp_path, "--neuron", "--compiler-workdir", str(tmp_path / "cc"),
                     neuronx_stub=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "plain reading: agrees" in done.stdout and "port's traced layer (TP 2): FAILS" in done.stdout
    # --neuron: the failing call of each rank through torch_neuronx.trace (a stand-in with its
    # signature, tracing on this CPU): inputs x, positions, per-layer inputs, k, v, one sum per all-reduce
    assert "port's layer on neuron: FAILS" in done.stdout
    calls = [json.loads(line) for line in (tmp_path / "neuronx.log").read_text().splitlines()]
    assert calls == [{"inputs": 7, "workdir": str(tmp_path / "cc" / f"rank{r}")} for r in range(2)], calls
    refused = run_repro(tmp_path / "repro", tmp_path, "--neuron")  # no torch-neuronx: refused before any work
    assert refused.returncode == 2 and "--neuron needs torch-neuronx" in refused.stderr and not refused.stdout
    for bad in (["--nueron"], ["--compiler-workdir", "x"]):
        done = run_repro(tmp_path / "repro", tmp_path, *bad)
        assert done.returncode == 2 and "usage:" in done.stderr and not done.stdout, bad


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


def test_a_replay_that_routes_otherwise_judges_only_what_its_routing_cannot_move():
    """A MoE replay choosing other experts at layer 2 than the recorded call (a router near tie on
    another backend): points from layer 2's experts on are outside the judge (the stored references
    follow the recorded routing), those before still judge; so a departure only there is no
    reproduction, not named a divergence; one before layer 2's experts still is."""
    def point(name, ratio):
        return PointResult(name, 0.1, 0.9, 0.1, 0.01, ratio, ratio, 0, True, ratio <= 4.0)

    snap = type("S", (), {"target": {"failing": False}})()
    after = [point("layers.1.output", 1), point("layers.2.router_logits", 1), point("kv.2.k", 1),
             point("layers.2.mlp_residual", 30), point("layers.3.output", 40), point("final_norm", 40)]
    moved = BackendReplay("cpu", 1, "whole", after, rerouted=[2])
    assert not moved.reproduces and "not judged (3 of them outside the judge)" in moved.describe()
    assert BackendReplay("cpu", 1, "whole", after).reproduces  # the same departures, routed as recorded
    named = whose(snap, [_replay("xla", 1), moved])
    assert named.startswith("no backend run") and "cpu routes otherwise" in named and "compilation" not in named
    before = [point("layers.1.output", 30)] + after[1:]
    assert BackendReplay("cpu", 1, "whole", before, rerouted=[2]).reproduces
    snap.target["failing"] = True  # a fault the recording backend alone shows: still that backend's, named
    named = whose(snap, [BackendReplay("neuron", 1, "whole", after), moved])
    assert "compilation or runtime divergence of neuron" in named and "cpu routes otherwise" in named
    earlier = BackendReplay("cpu", 1, "whole", after[3:], rerouted=[1])
    assert not earlier.reproduces and "judged no point" in earlier.describe()
    assert BackendReplay("cpu", 1, "whole", [point("layers.2.router_logits", 30)], rerouted=[2]).reproduces


def test_the_repro_exempts_the_experts_only_where_this_cpu_reroutes_as_its_plain_reading():
    """fixtures/repro/repro.py's rule: the expert points are left unjudged only when the plain
    reading on this CPU chooses other experts than the recorded call and the port's traced layer
    chooses exactly as the plain reading (a near tie resolved otherwise here); a port choosing
    otherwise than the plain reading, or a plain reading routing as recorded, is judged whole."""
    import runpy
    from pathlib import Path

    import torch

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "fixtures/repro/repro.py"), run_name="repro")
    rerouted_here = script["rerouted_here"]

    def weights(*rows):  # each row's chosen experts, weighted, zero elsewhere (4 experts)
        out = torch.zeros(len(rows), 4)
        for r, chosen in enumerate(rows):
            out[r, list(chosen)] = torch.tensor([0.6, 0.4])
        return {"expert_weights": out}

    meta = {"points": ["attn_residual", "router_logits", "expert_weights", "mlp_residual"], "config": {"top_k": 2}}
    t = {"ref." + k: v for k, v in weights((0, 1), (2, 3)).items()}
    here = weights((0, 2), (2, 3))
    assert rerouted_here(here, here, t, meta)
    assert not rerouted_here(here, weights((0, 1), (2, 3)), t, meta)  # the port chose otherwise than plain
    assert not rerouted_here(weights((0, 1), (2, 3)), weights((1, 3), (2, 3)), t, meta)  # plain routes as recorded
    assert not rerouted_here(here, here, t, {**meta, "points": ["attn_residual", "mlp_residual"]})  # no router


@pytest.mark.slow  # a family reference and two repro runs, ~25 CPU-s; sibling: test_a_planted_fault_snapshots_replays_and_its_repro_exits_1
def test_a_kv_shared_layers_decode_step_repro_carries_its_source(tmp_path):
    """The E4B's KV-shared layer 8 at a teacher-forced decode step, TP 2, without a check (a control
    target on the references): the repro runs the engine's prefill and decode calls with the
    source layer's cache on both ranks and agrees (exit 0); emitted with the shared layer bound to
    the wrong source (kv-shared-source-off-by-one), the same repro exits 1 while its plain reading,
    the model's own source, agrees. (The variant x TP matrix: test_snapshot_catalog.py.)"""
    from harness.snapshot.repro import write_repro
    from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_CATALOG, FAMILY_KV_LEN
    from tests.family.shared import family_checkpoint, family_reference
    from tests.snapshot.support import control_target, observation

    ckpt, refs = family_checkpoint("e4b"), family_reference("e4b")
    assert ckpt.spec.layers[8].kv_source == 7
    settings = RunSettings(tp=2, dtype="bfloat16", buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN)
    target, obs = control_target(refs, settings, layer=8, step=1), observation(refs)
    write_repro(ckpt, settings, target, obs, tmp_path / "clean", say=lambda line: None)
    fault = next(f for f in FAMILY_CATALOG if f.name == "kv-shared-source-off-by-one")
    with pytest.MonkeyPatch.context() as mp:
        fault.inject(mp)
        write_repro(ckpt, settings, target, obs, tmp_path / "fault", say=lambda line: None)
    clean, faulty = run_repro(tmp_path / "clean", tmp_path), run_repro(tmp_path / "fault", tmp_path)
    assert clean.returncode == 0 and "KV-shared: reads layer 7" in clean.stdout, clean.stdout + clean.stderr
    assert "call 2 of the engine's 3" in clean.stdout  # one prefill chunk, then decode steps 0 and 1
    assert faulty.returncode == 1 and "plain reading: agrees" in faulty.stdout, faulty.stdout + faulty.stderr
