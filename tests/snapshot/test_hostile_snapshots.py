"""Hostile snapshots and their writes (issue 49's hostile set): a snapshot edited and resealed by
someone who knows the format (every digest and the seal recomputed) is refused field by field
(exit 2 naming the field, before model work, no traceback), and a Ctrl-C while a snapshot is put in
place either leaves nothing (before its rename) or lets the run finish with the snapshot whole
(after it), never "nothing was kept" beside a kept snapshot."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from harness.base import atomic, commit_point
from harness.cli import main
from harness.inputs.checkpoint import sha256_file
from harness.inputs import sealed
from harness.snapshot.fields import SNAPSHOT
from harness.snapshot.write import write_snapshot
from tests.snapshot.test_bad_snapshots import LAYER, SETTINGS, copy, reseal, snapshot  # noqa: F401 (fixture)


def _reseal_manifest(path, change) -> None:
    manifest = json.loads((path / SNAPSHOT.manifest).read_text())
    change(manifest)
    manifest["tensors_sha256"] = sha256_file(path / SNAPSHOT.tensors)
    manifest[SNAPSHOT.seal_key] = SNAPSHOT.seal(manifest, manifest["tensors_sha256"])
    (path / SNAPSHOT.manifest).write_text(json.dumps(manifest))


def _reseal_tensors(path, change) -> None:
    tensors = load_file(str(path / SNAPSHOT.tensors))
    change(tensors)
    manifest = json.loads((path / SNAPSHOT.manifest).read_text())
    manifest["tensors"] = {k: v for k, v in manifest["tensors"].items() if k in tensors}
    for name, t in tensors.items():
        manifest["tensors"][name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                     "sha256": ""}
    (path / SNAPSHOT.manifest).write_text(json.dumps(manifest))
    reseal(path, tensors, digests=True)


def _set(*keys, value=None, drop=False):
    def change(manifest):
        where = manifest
        for key in keys[:-1]:
            where = where[key]
        if drop:
            del where[keys[-1]]
        else:
            where[keys[-1]] = value
    return change


MANIFEST_CASES = {
    "checkpoint-missing": (_set("checkpoint", drop=True), "checkpoint is missing"),
    "tp-text": (_set("settings", "tp", value="x"), "settings.tp is 'x'"),
    "layer-null": (_set("target", "layer", value=None), "target.layer is None"),
    "layer-out-of-range": (_set("target", "layer", value=99), "target.layer is 99"),
    "kv-len-negative": (_set("settings", "kv_len", value=-5), "settings.kv_len is -5"),
    "stage-unknown": (_set("target", "stage", value="fp16"), "target.stage is 'fp16'"),
    "length-zero": (_set("target", "length", value=0), "target.length is 0"),
    "files-junk": (_set("checkpoint", "files", value=[1]), "checkpoint.files is [1]"),
}

TENSOR_CASES = {
    "float-positions": (lambda t: t.update({"call.positions": t["call.positions"].float()}),
                        "call.positions is float32, not an integer tensor"),
    "zero-d-tensor": (lambda t: t.update({f"ref.layers.{LAYER}.output": torch.tensor(1.0)}),
                      f"ref.layers.{LAYER}.output is 0-dimensional"),
    "input-missing": (lambda t: t.pop("call.inputs_embeds"), "tensor call.inputs_embeds is missing"),
    "judged-missing": (lambda t: (t.pop(f"env.layers.{LAYER}.output"), t.pop(f"port.layers.{LAYER}.output")),
                       f"tensor env.layers.{LAYER}.output is missing"),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES) + list(TENSOR_CASES))
def test_an_edited_and_resealed_snapshot_is_refused_naming_the_field(case, snapshot, tmp_path, monkeypatch,  # noqa: F811
                                                                     capsys):
    path = copy(snapshot, tmp_path)
    if case in MANIFEST_CASES:
        change, fragment = MANIFEST_CASES[case]
        _reseal_manifest(path, change)
    else:
        change, fragment = TENSOR_CASES[case]
        _reseal_tensors(path, change)

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started on a bad snapshot")

    monkeypatch.setattr("harness.parity.observe.build_port", no_model_work)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and "internal error" not in err, err


def _rewrite_via(path, tmp_path):
    """The snapshot's own contents written again with write_snapshot (as check --snapshot does)."""
    from harness.inputs.checkpoint import Checkpoint
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.target import Target

    snap = read_snapshot(path)
    target = Target(**{k: v for k, v in snap.target.items() if k != "graph_tag"})
    ckpt = Checkpoint.open(snap.manifest["checkpoint"]["path"])
    return lambda out: write_snapshot(out, ckpt, SETTINGS, target, snap.tensors, source="test", say=lambda line: None)


@pytest.mark.parametrize("when", ["before-rename", "after-rename"])
def test_ctrl_c_while_a_snapshot_is_put_in_place(when, snapshot, tmp_path, monkeypatch):  # noqa: F811
    """SIGINT just before the rename: KeyboardInterrupt, nothing left, a rerun may write it. Just after
    it (the window issue 49 found 1 in 5 times): the signal is held, the snapshot is whole and the
    run goes on (the command then says the signal came after the output was written)."""
    write = _rewrite_via(snapshot, tmp_path)
    real, real_verify = atomic._rename_into_place, sealed.SealedFormat.verify_written

    def rename(tmp, out_dir, replace):
        real(tmp, out_dir, replace)
        os.kill(os.getpid(), signal.SIGINT)

    def verify(*args):  # the tensors written, the manifest not yet: the temp directory half written
        os.kill(os.getpid(), signal.SIGINT)
        return real_verify(*args)

    if when == "before-rename":
        monkeypatch.setattr(sealed.SealedFormat, "verify_written", verify)
    else:
        monkeypatch.setattr(atomic, "_rename_into_place", rename)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    out = tmp_path / "out"
    commit_point.arm()  # as the command line does
    try:
        if when == "before-rename":
            with pytest.raises(KeyboardInterrupt):
                write(out)
            assert commit_point.finish() == []
            assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".partial-")]
            monkeypatch.setattr(sealed.SealedFormat, "verify_written", real_verify)
            write(out)  # the rerun is not refused as "already exists"
        else:
            write(out)  # no KeyboardInterrupt: the signal waits for the command's end
            assert commit_point.finish() == [signal.SIGINT]
        assert (out / SNAPSHOT.manifest).is_file() and (out / SNAPSHOT.tensors).is_file()
    finally:
        commit_point.finish()
        signal.signal(signal.SIGINT, previous)
