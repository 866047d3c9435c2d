"""HLO bundles on the XLA lane (docs/snapshot.md#the-hlo-bundle): the failing layer call of every layer
kind of the 12B and the family (sliding, full, k=v, per-layer inputs, KV-shared, MoE) at TP 1 and 2,
lowered by torch-xla one module per rank (each all-reduce cut at the rank's edge: the partial an
output, the true sum an input). Its check.sh, run with this package, transformers and torch
unimportable, agrees on XLA's CPU backend (exit 0) for every rank; a fault planted in the HLO text
(an operand swapped, a constant changed, a reduction narrowed to bf16) makes it exit 1 naming the
outputs that moved; `gemma-parity reduce` shrinks each planted bundle to at most a tenth of its
instructions, still failing, counts printed. The bundle's jax comes from GEMMA_PARITY_JAX_PATH
(.ci/xla-lane installs it apart from the venv)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harness.base.settings import RunSettings
from tests.bundle.support import jax_available, run_check

pytestmark = [pytest.mark.xla,
              pytest.mark.skipif(not jax_available(), reason="the bundle's CPU runner needs jax (.ci/xla-lane sets "
                                                             "GEMMA_PARITY_JAX_PATH)")]
# model, TP, layer, what the layer is. Every kind's clean bundles and planted faults run in the XLA lane's
# serial part (nightly); the reducer runs there on the 12B's sliding layer at TP 1 and the KV-shared layer
# (whose narrowed sums must survive its q/k/v norms); the other reductions are `matrix` cases
# (`bash .ci/xla-lane tests/xla/test_hlo_bundle.py -m matrix`). Verified 2026-12-07, each case alone at
# load 6-7 on 2 cores: all nine clean 0 on every rank, every planted fault 1, every reduction <= 1/10
# (at most 523 -> 49). The lane's part of this file took about 22 minutes there (checks 13, the two
# reductions 5.5, the decode graph 4); the seven matrix reductions 28 (docs/snapshot.md#tests: the table).
CASES = [("tiny", 1, 3, "sliding"), ("tiny", 2, 3, "sliding"), ("tiny", 1, 5, "full, k=v"), ("tiny", 2, 5, "full, k=v"),
         ("e2b", 1, 4, "full"), ("e2b", 2, 2, "per-layer inputs"), ("e2b", 1, 6, "KV-shared"),
         ("26b-a4b", 1, 1, "MoE"), ("26b-a4b", 2, 1, "MoE")]
_LANE_REDUCED = {("tiny", 1, 3), ("e2b", 1, 6)}
REDUCED = [c if c[:3] in _LANE_REDUCED else pytest.param(*c, marks=pytest.mark.matrix) for c in CASES]
FAULTS = ("swap", "constant", "narrow")
_WRITTEN: dict = {}  # (model, tp, layer) -> (bundles, lines, spec, the per-layer inputs): lowered once a session


def bundles(name, tp, layer, request, tmp_path_factory):
    """The bundles of a control call of `layer` (the repro's engine calls on cpu, lowered on xla)."""
    from harness.snapshot.hlo_bundle import write_layer_bundles
    from harness.snapshot.repro import repro_inputs
    from harness.snapshot.traced_layer import rank_hosts
    from tests.snapshot.support import control_target, observation
    from tests.snapshot.test_snapshot_backends import model

    if (name, tp, layer) in _WRITTEN:
        return _WRITTEN[name, tp, layer]
    ckpt, refs, (buckets, kv_len) = model(name, request)
    settings = RunSettings(backend="cpu", tp=tp, buckets=buckets, kv_len=kv_len)
    target = control_target(refs, settings, layer=layer, prompt=1)
    obs = observation(refs)
    _, calls, _ = repro_inputs(ckpt, settings, target, obs)
    parts = [n.rsplit(".", 1)[1] for n in target_points(ckpt, layer)]
    lines = []
    written = write_layer_bundles(ckpt, settings, target, rank_hosts(ckpt, settings, layer, parts), calls,
                                  out_dir=tmp_path_factory.mktemp("bundles") / "out", say=lines.append)
    _WRITTEN[name, tp, layer] = written, lines, ckpt.spec, calls[-1]["ples"]
    return _WRITTEN[name, tp, layer]


def target_points(ckpt, layer):
    from harness.base.points import layer_points

    return layer_points(layer, spec=ckpt.spec)


def plain_inputs(bundle, spec, ples):
    """The module's inputs a kind needs, held as plain arrays under their names: every expert's
    weights (MoE), the call's per-layer inputs as given (per-layer inputs)."""
    import numpy as np

    manifest = json.loads((bundle / "bundle.json").read_text())
    params = {p["name"]: np.load(bundle / p["file"]) for p in manifest["params"]}
    if spec.moe is not None:
        experts = [n for n in params if ".experts." in n]
        assert sorted(n.rsplit(".", 1)[1] for n in experts) == ["down_proj", "gate_up_proj"], list(params)
        assert all(params[n].shape[0] == spec.moe.num_experts for n in experts), [params[n].shape for n in experts]
    if ples.numel():
        assert "ples" in params, list(params)
        np.testing.assert_array_equal(params["ples"], ples.float().numpy())


@pytest.mark.parametrize("name,tp,layer,kind", CASES)
def test_clean_bundles_agree_and_planted_faults_name_the_outputs_that_moved(name, tp, layer, kind, request,
                                                                            tmp_path, tmp_path_factory):
    from harness.bundle.faults import plant_bundle

    written, lines, spec, ples = bundles(name, tp, layer, request, tmp_path_factory)
    assert [p.name for p in written] == [f"hlo-rank{r}" for r in range(tp)], lines
    for bundle in written:
        manifest = json.loads((bundle / "bundle.json").read_text())
        assert manifest["failure"]["layer"] == layer and "one module per rank" in manifest["failure"]["collectives"]
        assert manifest["compile"]["command"].startswith("neuronx-cc compile --framework XLA module.hlo.pb --target")
        assert not [p for p in bundle.rglob("*") if p.suffix in (".pt", ".safetensors", ".bin")]
        plain_inputs(bundle, spec, ples)
        done = run_check(bundle, tmp_path, "cpu")
        assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    for fault in FAULTS:
        planted = tmp_path / f"planted-{fault}"
        what = plant_bundle(written[0], planted, fault)
        done = run_check(planted, tmp_path, "cpu")
        assert done.returncode == 1, (what, done.stdout + done.stderr)
        moved = re.findall(r"MOVED (\S+):", done.stdout)
        assert moved and f"outputs moved: {', '.join(moved)}" in done.stdout, done.stdout


@pytest.mark.parametrize("name,tp,layer,kind", REDUCED)
def test_reduce_shrinks_each_planted_fault_to_a_tenth_still_failing(name, tp, layer, kind, request, tmp_path,
                                                                    tmp_path_factory):
    from harness.bundle.faults import plant_bundle

    written, _, _, _ = bundles(name, tp, layer, request, tmp_path_factory)
    for fault in FAULTS:
        planted = tmp_path / f"planted-{fault}"
        what = plant_bundle(written[0], planted, fault)
        reduced = tmp_path / f"reduced-{fault}"
        out = subprocess.run([sys.executable, "-m", "harness", "reduce", str(planted), str(reduced)],
                             capture_output=True, text=True, timeout=1800)
        counts = re.search(r"reduce: (\d+) -> (\d+) instructions", out.stdout)
        assert out.returncode == 0 and counts, out.stdout + out.stderr
        before, after = map(int, counts.groups())
        print(f"{name} TP {tp} layer {layer} {fault}: {counts.group(0)}")  # the counts, shown with -s
        assert after * 10 <= before, (fault, what, before, after)
        again = run_check(reduced, tmp_path, "cpu")
        assert again.returncode == 1, (fault, again.stdout + again.stderr)


# Verified 2026-12-07: 227 s alone at load 6 (132 CPU-s: lowering the 5670 instructions, then a 14 s CPU
# run): in the lane's serial part, which runs nightly
def test_the_sliding_window_decode_graph_bundle_and_its_upstream_issue(tmp_path):
    """The first use (docs/snapshot.md#a-graph-the-compiler-crashes-on): the tiny 12B's decode graph (its
    sliding-window layers) as a bundle for the neuronx-cc release that crashes on such graphs, built
    off-chip: its CPU run agrees, and ISSUE.md names the versions, the command, what happens and what is
    expected."""
    done = subprocess.run([sys.executable, "-m", "harness.bundle.graph", str(tmp_path / "decode")],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    bundle = tmp_path / "decode"
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["toolchain"]["neuron"]["neuronx-cc"] == "2.27.5334" and manifest["compile"]["graph"] == "decode"
    assert "-O2" in manifest["compile"]["flags"].split()  # token generation compiles at -O2
    issue = (bundle / "ISSUE.md").read_text()
    for needed in ("neuronx-cc 2.27.5334", "NCC_ISMP902", manifest["compile"]["command"], "## What is expected",
                   "torch-neuronx", "## Versions"):
        assert needed in issue, needed
    clean = run_check(bundle, tmp_path, "cpu")
    assert clean.returncode == 0, clean.stdout + clean.stderr
