"""Golden files: a write/read round trip is lossless, the write is atomic (a failure leaves nothing
half written and an existing golden intact), an existing golden is never overwritten silently, and
reading refuses a corrupted golden or one made for another spec."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import harness.inputs.sealed
from harness.base.errors import GoldenError, OutputError
from harness.inputs.spec import spec_from_config_dict
from harness.inputs.tiny import TINY_CONFIG
from harness.reference.golden import MANIFEST, TENSORS, read_golden
from harness.reference.golden_write import write_golden

NEW_TOKENS = 8  # what the tiny0_reference fixture decodes


def _write(out_dir, ckpt, reference, **kwargs):
    return write_golden(out_dir, ckpt.spec, reference, NEW_TOKENS, ckpt.file_hashes(), str(ckpt.path), **kwargs)


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory, tiny0_ckpt, tiny0_reference):
    return _write(tmp_path_factory.mktemp("golden") / "tiny0", tiny0_ckpt, tiny0_reference)


def _other_spec():
    """The tiny model with a narrower sliding window: same tensor shapes, another architecture."""
    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"]["sliding_window"] = 8
    return spec_from_config_dict(config, "sliding-window-8/config.json")


def test_round_trip_is_lossless(golden_dir, tiny0_ckpt, tiny0_reference, default_prompts):
    """read_golden gives back the prompts, token counts, generated tokens, every capture and the
    step logits bit for bit, for both dtypes, and records the checkpoint's file hashes."""
    golden = read_golden(golden_dir, expected_spec=tiny0_ckpt.spec)
    assert golden.prompts == default_prompts
    assert golden.new_tokens == NEW_TOKENS
    assert golden.manifest["checkpoint"]["files"] == tiny0_ckpt.file_hashes()
    for dtype, runs in tiny0_reference.items():
        for original, read in zip(runs, golden.results(dtype), strict=True):
            assert read.prompt == original.prompt and read.dtype == dtype
            assert read.generated == original.generated
            assert read.captures.keys() == original.captures.keys()
            for name, tensor in original.captures.items():
                assert torch.equal(read.captures[name], tensor), (dtype, name)
            assert torch.equal(read.step_logits, original.step_logits)


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, tiny0_ckpt, tiny0_reference):
    """When writing the tensors fails half way, no golden directory and no temp directory remain,
    and the error names the golden's path (not the temp directory's)."""
    def save_half_then_fail(tensors, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError("No space left on device")

    monkeypatch.setattr(harness.inputs.sealed, "save_file", save_half_then_fail)
    with pytest.raises(OutputError, match=rf"{tmp_path / 'golden'}: cannot write \(No space") as caught:
        _write(tmp_path / "golden", tiny0_ckpt, tiny0_reference)
    assert ".partial-" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_golden(tmp_path, monkeypatch, golden_dir, tiny0_ckpt, tiny0_reference):
    """A failing deliberate overwrite leaves the previous golden readable and unchanged."""
    target = tmp_path / "golden"
    shutil.copytree(golden_dir, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(harness.inputs.sealed, "save_file", fail)
    with pytest.raises(OutputError, match="No space"):
        _write(target, tiny0_ckpt, tiny0_reference, overwrite=True)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["golden"]


def test_existing_golden_is_not_overwritten_silently(tmp_path, golden_dir, tiny0_ckpt, tiny0_reference):
    """Without overwrite=True the write is refused (naming the directory and --overwrite) and the
    old files stay; with it, the new golden replaces the old one."""
    target = tmp_path / "golden"
    shutil.copytree(golden_dir, target)
    before = (target / MANIFEST).read_bytes()
    fp32_only = {"float32": tiny0_reference["float32"]}
    with pytest.raises(GoldenError, match=r"golden.*--overwrite"):
        _write(target, tiny0_ckpt, fp32_only)
    assert (target / MANIFEST).read_bytes() == before
    _write(target, tiny0_ckpt, fp32_only, overwrite=True)
    replaced = read_golden(target)
    assert sorted(replaced.manifest["results"]) == ["float32"]
    with pytest.raises(GoldenError, match="bfloat16"):
        replaced.results("bfloat16")


def test_corrupted_tensors_are_refused(tmp_path, golden_dir, tiny0_ckpt):
    """One flipped byte in tensors.safetensors fails the hash check: GoldenError naming the file
    and saying to regenerate."""
    target = tmp_path / "golden"
    shutil.copytree(golden_dir, target)
    data = bytearray((target / TENSORS).read_bytes())
    data[len(data) // 2] ^= 0x01
    (target / TENSORS).write_bytes(bytes(data))
    with pytest.raises(GoldenError, match=rf"{TENSORS}.*regenerate"):
        read_golden(target, expected_spec=tiny0_ckpt.spec)


@pytest.mark.parametrize("missing", [MANIFEST, TENSORS])
def test_incomplete_golden_is_refused(tmp_path, golden_dir, missing):
    """A golden without its manifest or its tensors is a GoldenError naming what is missing."""
    target = tmp_path / "golden"
    shutil.copytree(golden_dir, target)
    (target / missing).unlink()
    with pytest.raises(GoldenError, match=missing):
        read_golden(target)


def test_golden_of_another_spec_is_refused(golden_dir, tiny0_ckpt):
    """A golden only compares against the architecture it was made for: the tiny model with another
    sliding window is refused with both spec hashes named; its own spec is accepted."""
    other = _other_spec()
    assert other.spec_hash() != tiny0_ckpt.spec.spec_hash()
    with pytest.raises(GoldenError, match=rf"{tiny0_ckpt.spec.spec_hash()}.*{other.spec_hash()}.*regenerate"):
        read_golden(golden_dir, expected_spec=other)
    assert read_golden(golden_dir, expected_spec=tiny0_ckpt.spec).manifest["spec_hash"] == tiny0_ckpt.spec.spec_hash()
