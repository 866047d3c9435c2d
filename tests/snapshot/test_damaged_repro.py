"""A damaged repro never reads as "reproduces" (exit 1): repro.py (fixtures/repro/repro.py) and the
host step's (fixtures/repro/host_repro.py) exit 2 with one line naming the file, no traceback, for a
truncated or missing repro.safetensors, a missing, junk or pickled port_rank*.pt (never unpickled),
broken metadata, a missing tensor. The untouched copies are the controls (exit 0)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harness.base.settings import RunSettings
from tests.faults.catalog import TINY, engine_options
from tests.snapshot.support import BLOCKER, control_target, observation

SETTINGS = RunSettings(**engine_options(TINY))


@pytest.fixture(scope="module")
def layer_repro(tmp_path_factory, tiny0_ckpt, tiny0_reference) -> Path:
    from harness.snapshot.repro import write_repro

    out = tmp_path_factory.mktemp("layer-repro") / "r"
    target = control_target(tiny0_reference, SETTINGS, layer=1)
    write_repro(tiny0_ckpt, SETTINGS, target, observation(tiny0_reference), out, say=lambda line: None)
    return out


@pytest.fixture(scope="module")
def host_repro(tmp_path_factory) -> Path:
    """A probabilities host-step repro of a right port: softmax of capped logits (numbers computed here)."""
    from harness.judge import compare
    from harness.snapshot.repro import save_repro

    logits = torch.randn(2, 50) * 10
    capped = torch.tanh(logits / 30.0) * 30.0
    tensors = {"logits": logits, "ref": capped, "port": torch.softmax(capped.double(), -1).float()}
    meta = {"kind": "probabilities", "dtype": "float32", "cap": 30.0, "relative": compare.HOST_RELATIVE_TOLERANCE,
            "tv": compare.HOST_TV_TOLERANCE, "floor": compare.HOST_PROBABILITY_FLOOR, "description": "a test step"}
    out = tmp_path_factory.mktemp("host-repro") / "r"
    return save_repro(out, tensors, meta, [], what="a test step", say=lambda line: None, script="host_repro.py")


def _tensors_and_meta(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path / "repro.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["repro"])


def _rewrite(path: Path, change_tensors=None, change_meta=None, raw_meta: str | None = None) -> None:
    tensors, meta = _tensors_and_meta(path)
    if change_tensors:
        change_tensors(tensors)
    if change_meta:
        change_meta(meta)
    save_file(tensors, str(path / "repro.safetensors"), metadata={"repro": raw_meta or json.dumps(meta)})


def truncated(path):
    data = (path / "repro.safetensors").read_bytes()
    (path / "repro.safetensors").write_bytes(data[: len(data) // 2])


def tensors_missing(path):
    (path / "repro.safetensors").unlink()


def port_missing(path):
    (path / "port_rank1.pt").unlink()


def port_junk(path):
    (path / "port_rank0.pt").write_bytes(b"not a traced layer" * 100)


class _Planted:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp") / f"h49-unpickled-{os.getpid()}"


def port_pickled(path):
    """A pickle that would run code if unpickled (torch.save's format, and a plain pickle)."""
    torch.save({"planted": _Planted()}, path / "port_rank0.pt")
    (path / "port_rank1.pt").write_bytes(pickle.dumps(_Planted()))


def port_directory(path):
    (path / "port_rank0.pt").unlink()
    (path / "port_rank0.pt").mkdir()


def meta_junk(path):
    _rewrite(path, raw_meta="{not json")


def meta_factor_removed(path):
    _rewrite(path, change_meta=lambda m: m.pop("factor"))


def meta_tp_text(path):
    _rewrite(path, change_meta=lambda m: m.update(tp="x"))


def tensor_removed(path):
    _rewrite(path, change_tensors=lambda t: t.pop("call0.xs"))


LAYER_CASES = {
    "truncated": (truncated, "repro.safetensors: cannot be read as safetensors"),
    "tensors-missing": (tensors_missing, "repro.safetensors: missing"),
    "port-missing": (port_missing, "port_rank1.pt: missing"),
    "port-junk": (port_junk, "port_rank0.pt: not a traced layer"),
    "port-pickled": (port_pickled, "port_rank0.pt: not a traced layer"),
    "port-directory": (port_directory, "port_rank0.pt: not a regular file"),
    "meta-junk": (meta_junk, "repro.safetensors: its metadata has no readable 'repro'"),
    "meta-factor": (meta_factor_removed, "its metadata is broken (factor"),
    "meta-tp": (meta_tp_text, "its metadata is broken (tp"),
    "tensor-removed": (tensor_removed, "do not run together"),
}


# Every damaged copy runs in one fresh interpreter (torch imported once: the default lane's budget),
# harness unimportable as in run_repro; each copy's own repro.py is loaded from its directory and its
# main() called, stderr captured, and anything escaping main() reported as a traceback.
DRIVER = """import contextlib, io, json, runpy, sys, traceback
out = {}
for name, path in json.loads(sys.argv[1]).items():
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            code = runpy.run_path(path + "/repro.py", run_name="repro")["main"]([])
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = 1
    out[name] = [code, err.getvalue(), std.getvalue()]
print(json.dumps(out))
"""


def _run_all(repro: Path, root: Path, cases: dict) -> dict:
    dirs = {}
    for name, (damage, _) in cases.items():
        dirs[name] = Path(shutil.copytree(repro, root / name))
        damage(dirs[name])
    dirs["untouched"] = repro
    (root / "driver.py").write_text(DRIVER)
    blocker = root / "blocker" / "harness"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(blocker.parent)}
    MARKER.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, str(root / "driver.py"), json.dumps({k: str(v) for k, v in dirs.items()})],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return {name: (code, err, out) for name, (code, err, out) in json.loads(done.stdout).items()}


@pytest.fixture(scope="module")
def layer_runs(layer_repro, tmp_path_factory):
    return _run_all(layer_repro, tmp_path_factory.mktemp("damaged-layer"), LAYER_CASES)


@pytest.fixture(scope="module")
def host_runs(host_repro, tmp_path_factory):
    return _run_all(host_repro, tmp_path_factory.mktemp("damaged-host"), HOST_CASES)


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_a_damaged_layer_repro_exits_2_naming_the_file(case, layer_runs):
    code, err, _ = layer_runs[case]
    assert code == 2, (code, err)
    assert LAYER_CASES[case][1] in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not MARKER.exists(), "a planted pickle was executed"


def test_the_untouched_layer_repro_agrees(layer_runs):
    code, err, out = layer_runs["untouched"]
    assert code == 0 and "does not reproduce" in out, (code, err, out)


HOST_CASES = {
    "truncated": (truncated, "repro.safetensors: cannot be read as safetensors"),
    "meta-junk": (meta_junk, "its metadata has no readable 'repro'"),
    "kind-unknown": (lambda p: _rewrite(p, change_meta=lambda m: m.update(kind="nonsense")), "metadata is broken"),
    "tensor-removed": (lambda p: _rewrite(p, change_tensors=lambda t: t.pop("logits")), "do not fit its kind"),
    "meta-cap-text": (lambda p: _rewrite(p, change_meta=lambda m: m.update(cap="x")), "do not fit its kind"),
}


@pytest.mark.parametrize("case", list(HOST_CASES))
def test_a_damaged_host_repro_exits_2_naming_the_file(case, host_runs):
    code, err, _ = host_runs[case]
    assert code == 2, (code, err)
    assert HOST_CASES[case][1] in err and "repro.safetensors" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_untouched_host_repro_agrees(host_runs):
    code, err, out = host_runs["untouched"]
    assert code == 0 and "does not reproduce" in out, (code, err, out)
