"""Bad snapshots are refused (exit 2) before any model work, each naming its problem: truncated,
edited and resealed, an edited manifest, another checkpoint, another layer's weights; and an
interrupted write leaves nothing behind. The snapshot they start from is a real one of the clean
tiny 12B, recorded from the reference's own observation (one prefill of the port)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.base.settings import RunSettings
from harness.base.errors import OptionError
from harness.cli import main
from harness.cli.snapshot_hooks import validate_snapshot_args
from harness.inputs.checkpoint import sha256_file
from harness.snapshot.record import rank_layer_weights, record_call
from harness.snapshot.target import Target
from tests.snapshot.support import observation
from harness.inputs.sealed import tensor_digest
from harness.snapshot.fields import SNAPSHOT
from harness.snapshot.write import layer_weights_digest, write_snapshot

MANIFEST, TENSORS = SNAPSHOT.files

SETTINGS = RunSettings(buckets=(64, 256), kv_len=288)
LAYER, OTHER = 1, 2  # two sliding layers of the tiny 12B: same shapes, other weights


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, tiny0_ckpt, tiny0_reference) -> Path:
    target = Target(stage="bf16", point=f"layers.{LAYER}.output", layer=LAYER, ratio=1.0, failing=False, prompt=1,
                    position=3, start=0, length=len(tiny0_reference["float32"][1].prompt), bucket=64)
    tensors = record_call(tiny0_ckpt, SETTINGS, target, observation(tiny0_reference))
    out = tmp_path_factory.mktemp("snap") / "s"
    write_snapshot(out, tiny0_ckpt, SETTINGS, target, tensors, source="test", say=lambda line: None)
    return out


def copy(snapshot: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(snapshot, tmp_path / "copy"))


def reseal(path: Path, tensors: dict, digests: bool) -> None:
    """Rewrite the tensors and recompute the file hash and the seal (and, with `digests`, every
    per-tensor digest and the layer digest: a forger who knows the format)."""
    save_file(tensors, str(path / TENSORS))
    manifest = json.loads((path / MANIFEST).read_text())
    if digests:
        for name, t in tensors.items():
            manifest["tensors"][name]["sha256"] = tensor_digest(t)
        manifest["layer_weights_sha256"] = layer_weights_digest(tensors)
    manifest["tensors_sha256"] = sha256_file(path / TENSORS)
    manifest[SNAPSHOT.seal_key] = SNAPSHOT.seal(manifest, manifest["tensors_sha256"])
    (path / MANIFEST).write_text(json.dumps(manifest))


def truncated(path, ckpt, tmp):
    data = (path / TENSORS).read_bytes()
    (path / TENSORS).write_bytes(data[: len(data) // 2])


def resealed(path, ckpt, tmp):
    tensors = load_file(str(path / TENSORS))
    tensors[f"ref.layers.{LAYER}.output"] = tensors[f"ref.layers.{LAYER}.output"] * 1.01
    reseal(path, tensors, digests=False)


def manifest_edited(path, ckpt, tmp):
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["target"]["ratio"] = 99.0
    (path / MANIFEST).write_text(json.dumps(manifest))


def other_layers_weights(path, ckpt, tmp):
    tensors = {k: v for k, v in load_file(str(path / TENSORS)).items() if not k.startswith("weights.")}
    for rank, weights in enumerate(rank_layer_weights(ckpt, 2, OTHER, torch.bfloat16)):
        tensors.update({f"weights.r{rank}.{k}": v for k, v in weights.items()})
    reseal(path, tensors, digests=True)


def other_checkpoint(path, ckpt, tmp):
    """A copy of the checkpoint with one weight changed: passed with --checkpoint."""
    other = Path(shutil.copytree(ckpt.path, tmp / "other-ckpt"))
    shard = next(other.glob("*.safetensors"))
    weights = load_file(str(shard))
    name = next(k for k in weights if k.endswith("input_layernorm.weight"))
    weights[name] = weights[name] + 1
    save_file(weights, str(shard), metadata={"format": "pt"})
    return ["--checkpoint", str(other)]


CASES = {
    "truncated": (truncated, "truncated, corrupted or edited"),
    "resealed": (resealed, "edited and resealed"),
    "manifest-edited": (manifest_edited, f"do not match its {SNAPSHOT.seal_key}"),
    "other-checkpoint": (other_checkpoint, "written from another checkpoint"),
    "other-layers-weights": (other_layers_weights, f"they are layer {OTHER}'s"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_snapshot_exits_2_before_model_work(case, snapshot, tiny0_ckpt, tmp_path, monkeypatch, capsys):
    spoil, fragment = CASES[case]
    path = copy(snapshot, tmp_path)
    extra = spoil(path, tiny0_ckpt, tmp_path) or []

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started on a bad snapshot")

    monkeypatch.setattr("harness.parity.observe.build_port", no_model_work)
    assert main(["replay", str(path), *extra]) == 2
    assert fragment in capsys.readouterr().err


def test_the_unspoiled_copy_replays_to_0(snapshot, tmp_path, capsys):
    """Control for the cases above: the same copy, untouched, is accepted and agrees on cpu."""
    assert main(["replay", str(copy(snapshot, tmp_path)), "--backend", "cpu"]) == 0
    assert "agrees" in capsys.readouterr().out


def test_an_interrupted_write_leaves_nothing(tmp_path, tiny0_ckpt, monkeypatch):
    """A signal (KeyboardInterrupt) while the tensors are written: no snapshot directory and no
    temp directory beside it."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("harness.inputs.sealed.save_file", interrupted)
    target = Target("bf16", "layers.0.output", 0, 1.0, False, 0, 0, 0, 1, 64)
    tensors = {f"weights.r0.{k}": v for k, v in rank_layer_weights(tiny0_ckpt, 1, 0, torch.bfloat16)[0].items()}
    with pytest.raises(KeyboardInterrupt):
        write_snapshot(tmp_path / "s", tiny0_ckpt, SETTINGS, target, tensors, source="test", say=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_snapshot_options_are_refused_before_model_work(tmp_path, capsys):
    """An existing directory, --batch N, truncate mode, and one directory for both outputs."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    cases = [(["check", "--model", "tiny", "--snapshot", str(tmp_path / "full")], "already exists"),
             (["check", "--model", "tiny", "--batch", "2", "--snapshot", str(tmp_path / "a")], "drop --batch 2")]
    for argv, fragment in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert fragment in err, err
    same = SimpleNamespace(snapshot=str(tmp_path / "d"), emit_repro=str(tmp_path / "d"), settings=RunSettings())
    with pytest.raises(OptionError, match="name the same directory"):
        validate_snapshot_args(same)
    truncate = SimpleNamespace(snapshot=str(tmp_path / "e"), mode="truncate", settings=RunSettings())
    with pytest.raises(OptionError, match="add --mode capture"):
        validate_snapshot_args(truncate)


def test_a_passing_check_snapshots_its_worst_layer_point_as_a_control(tiny0_ckpt, tiny0_reference):
    """A check that passes still has a call to snapshot (a control): the bf16 stage's worst prefill layer
    point, not failing (the xla lane's clean snapshot takes this path)."""
    from harness.snapshot.target import choose_target
    from tests.snapshot.support import run_check

    result = run_check(tiny0_ckpt, tiny0_reference, SETTINGS, fp32=False)
    assert result.passed, result.failures()[:3]
    target = choose_target(result, SETTINGS)
    assert target.stage == "bf16" and not target.failing and target.point.startswith("layers.")
    from harness.base.points import Point

    points = [p for layer in result.bf16.layers for p in layer.points if Point.parse(p.name).kind == "layer"]
    worst = max(points, key=lambda p: p.required_factor)
    assert target.point == worst.name
