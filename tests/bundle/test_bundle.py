"""HLO bundles without torch-xla (docs/snapshot.md#the-hlo-bundle), on a small hand-written bundle
(tests/bundle/data/small: its proto, full text and reference run made by jaxlib): the planted faults
edit the text as they say; bad bundles are refused with exit 2 and a line naming what is wrong (a
missing or altered file, another toolchain), before any module runs, with this package, transformers
and torch unimportable; the device half compiles through the NxD double's compile stand-in. With jax
(the XLA lane): the clean bundle exits 0, each planted fault 1, and `reduce` shrinks it still failing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.bundle import hlo_text
from harness.bundle.faults import KINDS, plant, plant_bundle
from tests.bundle.support import jax_available, run_check

SMALL = Path(__file__).parent / "data" / "small"
DOUBLE_SDK = Path(__file__).parents[1] / "nxd_double" / "sdk"


@pytest.fixture
def bundle(tmp_path):
    out = Path(shutil.copytree(SMALL, tmp_path / "small"))
    # the runner every bundle carries is the project's fixture, copied in as the writer does (its sha256
    # is recorded in bundle.json, so a runner that drifts from the fixture is refused, exit 2)
    shutil.copy(Path(__file__).resolve().parents[2] / "fixtures" / "bundle" / "run_hlo.py", out / "run_hlo.py")
    return out


def test_each_planted_fault_edits_the_text_as_it_says():
    text = (SMALL / "module.hlo.txt").read_text()
    swapped, what = plant(text, "swap")
    assert "%shift" in what and re.search(r"%shift = \S+ subtract\(%inv38, %wide\)", swapped), swapped
    changed, what = plant(text, "constant")
    assert "0.5 to 1.5" in what and "constant(1.5)" in changed and "constant(0.5)" not in changed
    narrowed, what = plant(text, "narrow")
    assert "%sum" in what and "bf16[3]{0} reduce(%sum.in, %sum.init)" in narrowed and "%narrowed.add" in narrowed
    # every reduction over the most elements narrows (one alone can be rescaled away downstream), no other
    more = text.replace("  %half = ", "  %sum2 = f32[3]{0} reduce(%wide, %zero), dimensions={1}, to_apply=%add\n"
                                      "  %col = f32[8]{0} reduce(%wide, %zero), dimensions={0}, to_apply=%add\n  %half = ")
    narrowed, what = plant(more, "narrow")
    assert "%sum, %sum2 (over 8 elements" in what and "reduce(%sum2.in, %sum2.init)" in narrowed, what
    assert "%col = f32[8]{0} reduce(%wide, %zero)" in narrowed and "%col.in" not in narrowed
    assert hlo_text.render(hlo_text.parse(text)).count(" = ") == text.count(" = ") - 0  # round trip keeps every line
    m = hlo_text.parse(text)
    m.root = "sum"
    assert hlo_text.dce(m) == [0, 1] and "eps" not in hlo_text.render(m)  # eps unused: dropped, the rest renumbered


def test_bad_bundles_are_refused_with_exit_2_naming_what_is_wrong(bundle, tmp_path):
    (bundle / "inputs" / "p001.npy").unlink()
    done = run_check(bundle, tmp_path, "cpu")
    assert done.returncode == 2 and "p001.npy: missing" in done.stderr, done.stderr
    shutil.copy(SMALL / "inputs" / "p001.npy", bundle / "inputs" / "p001.npy")
    data = bytearray((bundle / "inputs" / "p000.npy").read_bytes())
    data[-1] ^= 1
    (bundle / "inputs" / "p000.npy").write_bytes(bytes(data))
    done = run_check(bundle, tmp_path, "cpu")
    assert done.returncode == 2 and "p000.npy: altered" in done.stderr, done.stderr
    (bundle / "bundle.json").unlink()
    done = run_check(bundle, tmp_path)
    assert done.returncode == 2 and "no bundle.json" in done.stderr, done.stderr


def test_the_device_half_refuses_another_compiler_and_compiles_through_the_double(bundle, tmp_path):
    manifest = json.loads((bundle / "bundle.json").read_text())
    manifest["toolchain"]["neuron"] = dict(manifest["toolchain"].get("neuron", {}), **{"neuronx-cc": "2.27.5334"})
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    done = run_check(bundle, tmp_path, "neuron", extra_path=str(DOUBLE_SDK))
    assert done.returncode == 2 and "neuronx-cc 2.26.6360" in done.stderr and "2.27.5334" in done.stderr, done.stderr
    manifest["toolchain"]["neuron"]["neuronx-cc"] = "2.26.6360"
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    work = tmp_path / "work"
    done = run_check(bundle, tmp_path, "neuron", "--workdir", str(work), extra_path=str(DOUBLE_SDK))
    # compiled by the double's neuron_xla_compile (the flags parsed as neuronx-cc parses them); no runtime here
    assert "compiling: neuronx-cc compile" in done.stdout and (work / "module.neff").is_file(), done.stdout
    assert json.loads((work / "module.neff").read_text())["flags"] == manifest["compile"]["flags"]
    assert done.returncode == 2 and "needs nrtpy" in done.stderr, done.stderr


def test_reduce_refuses_a_bad_bundle_before_any_work(bundle, tmp_path):
    (bundle / "module.hlo.txt").write_text((bundle / "module.hlo.txt").read_text() + "\n")
    done = subprocess.run([sys.executable, "-m", "harness", "reduce", str(bundle), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "module.hlo.txt: altered" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    from types import SimpleNamespace

    from harness.base.errors import OptionError
    from harness.cli.reduce import validate
    with pytest.raises(OptionError, match="no bundle.json"):
        validate(SimpleNamespace(bundle=str(tmp_path), out=str(tmp_path / "out")))


@pytest.mark.skipif(not jax_available(), reason="the CPU run needs jax (the XLA lane sets GEMMA_PARITY_JAX_PATH)")
@pytest.mark.parametrize("kind", KINDS)
def test_with_jax_clean_agrees_planted_moves_and_reduces(kind, bundle, tmp_path):
    done = run_check(bundle, tmp_path, "cpu")
    assert done.returncode == 0 and "PASS: all 2 outputs" in done.stdout, done.stdout + done.stderr
    planted = tmp_path / "planted"
    plant_bundle(bundle, planted, kind)
    done = run_check(planted, tmp_path, "cpu")
    assert done.returncode == 1 and "MOVED" in done.stdout, done.stdout + done.stderr
    out = subprocess.run([sys.executable, "-m", "harness", "reduce", str(planted), str(tmp_path / "reduced")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and re.search(r"reduce: \d+ -> \d+ instructions", out.stdout), out.stdout + out.stderr
    assert run_check(tmp_path / "reduced", tmp_path, "cpu").returncode == 1


def test_the_issue_text_comes_from_the_bundle():
    from harness.bundle.graph import issue_text

    manifest = json.loads((SMALL / "bundle.json").read_text())
    manifest["failure"]["observed"] = "neuronx-cc exits 70 (NCC_ISMP902)"
    text = issue_text(manifest)
    assert manifest["compile"]["command"] in text and "neuronx-cc exits 70 (NCC_ISMP902)" in text
    assert f"neuronx-cc {manifest['toolchain']['neuron']['neuronx-cc']}" in text and "## What is expected" in text
    del manifest["failure"]["observed"]
    assert "NCC_ISMP902" not in issue_text(manifest)  # what happens is the bundle's, not a fixed string
