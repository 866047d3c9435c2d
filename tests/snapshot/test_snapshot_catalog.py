"""The slow lane of the snapshot suite (default-lane siblings: tests/snapshot/test_snapshot.py).

- Every fault of the catalog that `check` catches yields a snapshot whose replay on cpu, with the
  fault still planted, reproduces it (except the recorded REPLAY_GAPS: none), and whose repro.py
  (harness unimportable) exits 1, except the recorded REPRO_GAPS (none; decode steps included: the
  repro runs the engine's calls up to the step): at a layer point, first in its bit-exact layer
  stage, at the call's head (the logits) or in a host step (the embedding lookup, the served
  probabilities, the reported tokens, the step that raised: harness/snapshot/host.py); REFUSED
  (none) would list a fault `--snapshot` refuses, with its reason.
- Every family variant at TP 1 and 2: the clean control replays to 0 and its repro exits 0; one
  fault of the variant replays as reproduced.
- A fault planted only in the NxD double's compiled path replays as neuron's divergence alone.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.base.errors import OptionError
from harness.base.settings import RunSettings
from tests.faults.catalog import (BY_NAME, CATALOG, FAMILY_BUCKETS, FAMILY_KV_LEN, LONG, TINY, TINY_INEXACT_SCALE,
                                  engine_options)
from tests.family.shared import family_checkpoint, family_reference
from tests.snapshot.support import BLOCKER, run_check, snapshot_flow, through_the_double

FIXTURES = {TINY: ("tiny0_ckpt", "tiny0_reference"), TINY_INEXACT_SCALE: ("inexact_scale_ckpt", "inexact_scale_reference"),
            LONG: ("long_ckpt", "long_reference")}
# Faults whose snapshot replays but whose one-layer repro cannot show them, and why: none. The repro
# runs the engine's own calls (their positions, padding, KV buckets; a decode step's prefill and
# earlier steps) on every rank of the TP plan, fed the reference's input rows: chunk, ring, decode
# and TP plan faults reproduce (measured 2026-12-03). A fault whose first failure is the bit-exact
# layer stage (rmsnorm-no-fp32-upcast: every point within the envelope) is snapshotted as that layer
# alone at TP 1 and judged bit for bit by its replay and its repro (harness/snapshot/bits.py); the
# catalog's `local` faults run with the local verdicts, so that stage runs for them.
# Faults caught at no layer point have the host step's or the head's repro (fixtures/repro/host_repro.py).
REPRO_GAPS: dict[str, str] = {}
# Faults --snapshot refuses, and why: none (an exception inside the port's host code is its raising
# step, harness/snapshot/host_raises.py; one inside a device call would be refused, none in the catalog).
REFUSED: dict[str, str] = {}
HOST_KINDS = {"embed-scale-not-cast": "embed", "decode-token-off-by-one": "tokens", "softcap-twice": None,
              "decode-raises": "raises",
              "host-softcap-without-divide": "probabilities", "shared-softcap-formula-wrong": "probabilities",
              "host-probabilities-uncapped": "probabilities"}


# Faults whose snapshot replays without reproducing, and why: none (measured 2026-12-03). The recorder
# takes the engine's own backend.forward inputs (harness/snapshot/calls.py), so host-side position
# faults (chunk-positions-offset, decode-from-bucket-length) are in the recorded call and reproduce.
REPLAY_GAPS: dict[str, str] = {}


def _run_repros(dirs, tmp_path) -> dict[str, int]:
    """Every emitted repro's exit status, from one interpreter where `import harness` fails."""
    blocker = tmp_path / "blocker" / "harness"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    driver = ("import runpy, sys, json\nout = {}\nfor d in sys.argv[1:]:\n"
              "    out[d] = runpy.run_path(d + '/repro.py', run_name='repro')['main']([])\nprint(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", driver, *map(str, dirs)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(blocker.parent), "PATH": "/usr/bin:/bin"}, timeout=600)
    assert done.returncode == 0, done.stderr
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the whole catalog, ~7 CPU-s a fault (one check, snapshot, repro, replay each); siblings: test_a_planted_fault_snapshots_replays_and_its_repro_exits_1, test_a_host_probability_fault_snapshots_replays_and_its_repro_exits_1
def test_every_caught_catalog_fault_replays_and_its_repro_exits_1(request, tmp_path):
    emitted, refused, reproduced, no_repro, bits = {}, {}, {}, {}, []
    for fault in CATALOG:
        ckpt_name, ref_name = FIXTURES[fault.checkpoint]
        ckpt, refs = request.getfixturevalue(ckpt_name), request.getfixturevalue(ref_name)
        settings = RunSettings(**engine_options(fault.checkpoint))
        out, repro = tmp_path / fault.name / "snap", tmp_path / fault.name / "repro"
        try:
            flow = snapshot_flow(fault, ckpt, refs, settings, out, repro, unplanted=fault.name in HOST_KINDS,
                                 local=fault.local)
        except OptionError as exc:
            refused[fault.name] = str(exc)
            continue
        reproduced[fault.name] = flow.replays[("cpu", "whole", True)].reproduces
        if fault.name in HOST_KINDS:
            target = flow.manifest["target"]
            assert target.get("host") == HOST_KINDS[fault.name], (fault.name, target)
            assert target.get("host") or target["point"] == "logits", (fault.name, target)
            assert target.get("step_name") == ("decode_step" if fault.name == "decode-raises" else None), target
            clean = flow.replays[("cpu", "whole", False)]
            assert not clean.reproduces, (fault.name, clean.describe())  # the same step on the fixed port agrees
            if not target.get("host"):  # the head: no layer runs alone behind it, so --layer is refused (exit 2)
                from harness.cli import main

                assert main(["replay", str(out), "--layer", str(target["layer"])]) == 2, fault.name
        if flow.manifest["target"]["stage"] == "bitwise_layers":
            bits.append(fault.name)
        if flow.repro_refused:
            no_repro[fault.name] = flow.repro_refused
        else:
            emitted[fault.name] = repro
    print({"refused": sorted(refused), "no repro": sorted(no_repro), "emitted": sorted(emitted), "bit-exact": bits})
    assert {n for n, r in reproduced.items() if not r} == set(REPLAY_GAPS), reproduced
    assert set(refused) == set(REFUSED) and all(REFUSED[n] in why for n, why in refused.items()), refused
    assert not no_repro, no_repro  # decode steps, KV-shared layers, host steps and the head have repros too
    assert len(reproduced) == len(CATALOG) - len(REFUSED), sorted(refused)
    assert "rmsnorm-no-fp32-upcast" in bits, bits  # its first failure: the bit-exact layer stage
    codes = _run_repros(emitted.values(), tmp_path)
    exits = {name: codes[str(d)] for name, d in emitted.items()}
    assert {n for n, c in exits.items() if c != 1} == set(REPRO_GAPS) & set(exits), exits


VARIANT_FAULTS = {"31b": "rope-interleaved-pairs", "e2b": "ple-combine-factor", "e4b": "kv-shared-source-off-by-one",
                  "26b-a4b": "topk-not-renormalised"}


@pytest.mark.slow  # every variant x TP; sibling: test_a_planted_fault_snapshots_replays_and_its_repro_exits_1
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANT_FAULTS))
def test_family_variant_control_and_fault(variant, tp, tmp_path):
    from tests.faults.catalog import FAMILY_CATALOG

    ckpt, refs = family_checkpoint(variant), family_reference(variant)
    settings = RunSettings(tp=tp, dtype="bfloat16", buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN)
    clean = snapshot_flow(None, ckpt, refs, settings, tmp_path / "clean", tmp_path / "clean-repro")
    assert not clean.manifest["target"]["failing"]
    assert not clean.replays[("cpu", "whole", True)].reproduces
    faults = {f.name: f for f in FAMILY_CATALOG} | BY_NAME
    fault = faults[VARIANT_FAULTS[variant]]
    planted = snapshot_flow(fault, ckpt, refs, settings, tmp_path / "fault")
    assert planted.manifest["target"]["failing"] and planted.replays[("cpu", "whole", True)].reproduces
    assert _run_repros([tmp_path / "clean-repro"], tmp_path)[str(tmp_path / "clean-repro")] == 0


@pytest.mark.slow  # traces and "compiles" through the NxD double; sibling: test_replay_names_whose_failure_it_is
def test_a_fault_in_the_doubles_compiled_path_is_neurons_alone(tiny0_ckpt, tiny0_reference, tmp_path):
    """The NxD double's row-parallel reduction returning each rank's own partial times TP instead of
    the sum (a miscompiled reduction; a uniform scale would vanish in the post-norms):
    check on neuron fails; the snapshot replays as reproduced on neuron and agreeing on cpu, named
    a compilation or runtime divergence of neuron."""
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.replay import replay, whose
    from harness.snapshot.write import snapshot_check

    with pytest.MonkeyPatch.context() as mp, through_the_double(mp, tmp_path):
        from neuronx_distributed.parallel_layers import layers as nxd_layers

        mp.setattr(nxd_layers, "reduce_from_tensor_model_parallel_region", lambda x, *a, **k: x * 2)
        settings = RunSettings(backend="neuron", tp=2, buckets=(64, 256), kv_len=288)
        result = run_check(tiny0_ckpt, tiny0_reference, settings)
        assert not result.passed
        snapshot_check(result, tiny0_ckpt, settings, tmp_path / "snap", source="check", say=lambda line: None)
        snap = read_snapshot(tmp_path / "snap")
        replays = [replay(snap, tiny0_ckpt, "cpu"), replay(snap, tiny0_ckpt, "neuron")]
    assert [r.reproduces for r in replays] == [False, True]
    assert "compilation or runtime divergence of neuron" in whose(snap, replays)
