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
# model, TP, layer, what the layer is
# One case runs in the XLA lane (each case lowers a layer, runs it on jax's CPU backend and reduces three
# planted faults: about 15 minutes of CPU on a loaded 2-core machine); the others are the `matrix` lane,
# run by hand (`bash .ci/xla-lane tests/xla/test_hlo_bundle.py -m matrix`). Verified so far: the 12B's
# sliding layer at TP 1 and TP 2 (docs/snapshot.md#the-hlo-bundle says what is not yet).
_MATRIX = pytest.mark.matrix
CASES = [("tiny", 1, 3, "sliding"),
         pytest.param("tiny", 2, 3, "sliding", marks=_MATRIX),
         pytest.param("tiny", 1, 5, "full, k=v", marks=_MATRIX), pytest.param("tiny", 2, 5, "full, k=v", marks=_MATRIX),
         pytest.param("e2b", 1, 4, "full", marks=_MATRIX), pytest.param("e2b", 2, 2, "per-layer inputs", marks=_MATRIX),
         pytest.param("e2b", 1, 6, "KV-shared", marks=_MATRIX),
         pytest.param("26b-a4b", 1, 1, "MoE", marks=_MATRIX), pytest.param("26b-a4b", 2, 1, "MoE", marks=_MATRIX)]
FAULTS = ("swap", "constant", "narrow")


def bundles(name, tp, layer, request, tmp_path):
    """The bundles of a control call of `layer` (the repro's engine calls on cpu, lowered on xla)."""
    from harness.snapshot.hlo_bundle import write_layer_bundles
    from harness.snapshot.repro import repro_inputs
    from harness.snapshot.traced_layer import rank_hosts
    from tests.snapshot.support import control_target, observation
    from tests.snapshot.test_snapshot_backends import model

    ckpt, refs, (buckets, kv_len) = model(name, request)
    settings = RunSettings(backend="cpu", tp=tp, buckets=buckets, kv_len=kv_len)
    target = control_target(refs, settings, layer=layer, prompt=1)
    obs = observation(refs)
    _, calls, _ = repro_inputs(ckpt, settings, target, obs)
    parts = [n.rsplit(".", 1)[1] for n in target_points(ckpt, layer)]
    lines = []
    written = write_layer_bundles(ckpt, settings, target, rank_hosts(ckpt, settings, layer, parts), calls,
                                  out_dir=tmp_path / "out", say=lines.append)
    return written, lines


def target_points(ckpt, layer):
    from harness.base.points import layer_points

    return layer_points(layer, spec=ckpt.spec)


@pytest.mark.parametrize("name,tp,layer,kind", CASES)
def test_clean_bundles_agree_and_planted_faults_are_named_and_reduced(name, tp, layer, kind, request, tmp_path):
    from harness.bundle.faults import plant_bundle

    written, lines = bundles(name, tp, layer, request, tmp_path)
    assert [p.name for p in written] == [f"hlo-rank{r}" for r in range(tp)], lines
    for bundle in written:
        manifest = json.loads((bundle / "bundle.json").read_text())
        assert manifest["failure"]["layer"] == layer and "one module per rank" in manifest["failure"]["collectives"]
        assert manifest["compile"]["command"].startswith("neuronx-cc compile --framework XLA module.hlo.pb --target")
        assert not [p for p in bundle.rglob("*") if p.suffix in (".pt", ".safetensors", ".bin")]
        done = run_check(bundle, tmp_path, "cpu")
        assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    for fault in FAULTS:
        planted = tmp_path / f"planted-{fault}"
        what = plant_bundle(written[0], planted, fault)
        done = run_check(planted, tmp_path, "cpu")
        assert done.returncode == 1, (what, done.stdout + done.stderr)
        moved = re.findall(r"MOVED (\S+):", done.stdout)
        assert moved and f"outputs moved: {', '.join(moved)}" in done.stdout, done.stdout
        reduced = tmp_path / f"reduced-{fault}"
        out = subprocess.run([sys.executable, "-m", "harness", "reduce", str(planted), str(reduced)],
                             capture_output=True, text=True, timeout=1800)
        counts = re.search(r"reduce: (\d+) -> (\d+) instructions", out.stdout)
        assert out.returncode == 0 and counts, out.stdout + out.stderr
        before, after = map(int, counts.groups())
        assert after * 10 <= before, (fault, what, before, after)
        again = run_check(reduced, tmp_path, "cpu")
        assert again.returncode == 1, (fault, again.stdout + again.stderr)


@pytest.mark.skip(reason="not yet verified: the decode graph's bundle (weights bound on the device as xla_lower does) "
                         "did not finish within 10 minutes on a machine at load 15; run it alone to verify, then unskip")
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
