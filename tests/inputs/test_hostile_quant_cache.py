"""The quantized model's cache entry (harness/inputs/quantized_checkpoint.py) is the tool's own derived
data: an entry edited in place (same size), one whose weights were replaced by a link to the original
checkpoint's, or one without its record is never reused: it is rebuilt from the checkpoint (a note
names it), so `check --quantize int8` judges the port against the quantized model, never against a
damaged copy. And `--quantize int8` with a TP degree the model cannot shard is refused before any
copy is written, naming the user's checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

from harness.cli import main
from harness.inputs import quantized_checkpoint as qc
from harness.inputs.quantize import dequantized_layer


def _flip_in_place(entry, ckpt):
    weights = next(p for p in entry.glob("*.safetensors"))
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # a byte near the end: inside a layer's weights, same size
        f.seek(size - 3)
        byte = f.read(1)
        f.seek(size - 3)
        f.write(bytes([byte[0] ^ 0x40]))
    assert weights.stat().st_size == size


def _link_to_original(entry, ckpt):
    weights = next(p for p in entry.glob("*.safetensors"))
    weights.unlink()
    os.symlink(ckpt.path / weights.name, weights)


def _record_removed(entry, ckpt):
    (entry / qc.RECORD).unlink()


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA_PARITY_CACHE", str(tmp_path / "cache"))
    qc._INTACT.clear()
    yield tmp_path / "cache"
    qc._INTACT.clear()


def _layer_matches_the_quantized_model(opened, ckpt) -> bool:
    got = opened.layer_weights(0, torch.float32)
    want = dequantized_layer(ckpt.layer_weights(0), dtype=torch.float32)
    return all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("damage, problem", [
    (_flip_in_place, "does not match the sha256 recorded"),
    (_link_to_original, "is a link"),
    (_record_removed, "is missing or unreadable"),
])
def test_a_damaged_cache_entry_is_rebuilt_not_reused(damage, problem, own_cache, tiny0_ckpt, capsys):
    first = qc.quantized_reference(tiny0_ckpt, "int8")
    entry = first.path
    assert _layer_matches_the_quantized_model(first, tiny0_ckpt)
    damage(entry, tiny0_ckpt)
    assert qc.copy_host_bytes(tiny0_ckpt, "int8") > 0, "the host gate counts the rebuild"
    again = qc.quantized_reference(tiny0_ckpt, "int8")
    err = capsys.readouterr().err
    assert problem in err and str(entry) in err and "rebuilding it from the checkpoint" in err, err
    assert "save" not in err, "the cache is the tool's: the user is not told to save anything"
    assert again.path == entry and not any(p.is_symlink() for p in entry.iterdir())
    assert qc.entry_problem(entry) is None
    assert _layer_matches_the_quantized_model(again, tiny0_ckpt)
    assert again.file_hashes() == {p.name: qc.sha256_file(p) for p in [entry / "config.json", *again.weight_files()]}


def test_an_intact_entry_is_reused_without_a_note(own_cache, tiny0_ckpt, capsys):
    """Control: nothing damaged, nothing rebuilt (the weights file is the same inode)."""
    first = qc.quantized_reference(tiny0_ckpt, "int8")
    inode = next(first.path.glob("*.safetensors")).stat().st_ino
    qc._INTACT.clear()  # a new process: verified from the record
    again = qc.quantized_reference(tiny0_ckpt, "int8")
    assert next(again.path.glob("*.safetensors")).stat().st_ino == inode
    assert "rebuilding" not in capsys.readouterr().err


def test_quantize_with_an_unshardable_tp_writes_no_copy(own_cache, tiny0_dir, tmp_path, monkeypatch, capsys):
    """--quantize int8 --tp 3: refused (exit 2) naming the user's checkpoint, before the copy is written."""
    monkeypatch.setattr(qc, "_write", lambda *a: (_ for _ in ()).throw(AssertionError("copy written")))
    code = main(["check", "--checkpoint", str(tiny0_dir), "--quantize", "int8", "--tp", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "--tp 3" in err and str(tiny0_dir) in err, err
    assert not (own_cache / "quantized").exists()
