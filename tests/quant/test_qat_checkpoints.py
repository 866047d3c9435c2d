"""QAT and pre-quantized checkpoints at the loader (harness/inputs/qat.py): a half-precision QAT
export is an ordinary checkpoint the loader describes; a packed low-bit one is refused with exit 2
before model work, naming the key."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.base.errors import CheckpointError
from harness.inputs.checkpoint import Checkpoint


def _copy(tiny0_dir, tmp_path, edit_config=None, weights: bool = False):
    """The tiny checkpoint beside `tmp_path`: its config copied (and edited), its weight files
    linked (copied when `weights`, to be edited)."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for entry in tiny0_dir.iterdir():
        if entry.suffix == ".safetensors" and not weights:
            (out / entry.name).symlink_to(entry)
        elif entry.is_file():
            shutil.copy2(entry, out / entry.name)
    if edit_config is not None:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_half_precision_qat_checkpoint_opens_and_is_described(tiny0_dir, tmp_path):
    def qat(config):
        config["_name_or_path"] = "google/gemma-4-12b-it-qat-unquantized"
        config["quantization_config"] = {"quant_method": "qat", "format": "unquantized"}

    ckpt = Checkpoint.open(_copy(tiny0_dir, tmp_path, qat))
    text = ckpt.describe()
    assert "QAT metadata" in text and "quantization_config" in text and "runs them as any checkpoint" in text
    assert Checkpoint.open(tiny0_dir).quantization_note is None  # a plain checkpoint says nothing


@pytest.mark.parametrize("qc, named", [({"quant_method": "gptq", "bits": 4}, "bits 4"),
                                       ({"quant_method": "awq", "bits": 8}, "quant_method 'awq'"),
                                       ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                         "config_groups": {"g": {"weights": {"num_bits": 4}}}}, "bits 4")])
def test_packed_low_bit_config_is_refused_naming_the_key(tiny0_dir, tmp_path, qc, named):
    path = _copy(tiny0_dir, tmp_path, lambda c: c.update(quantization_config=qc))
    with pytest.raises(CheckpointError, match="quantization_config has " + named.replace("(", r"\(")):
        Checkpoint.open(path)


def test_packed_tensor_is_refused_naming_it(tiny0_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = _copy(tiny0_dir, tmp_path, weights=True)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    key = next(k for k in tensors if k.endswith("layers.0.mlp.up_proj.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] // 2, dtype=torch.uint8)  # int4 packed
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {key.replace('.', '[.]')} is stored as U8"):
        Checkpoint.open(path)


def test_check_refuses_a_packed_checkpoint_with_exit_2(tiny0_dir, tmp_path, capsys):
    from harness.cli import main

    path = _copy(tiny0_dir, tmp_path, lambda c: c.update(quantization_config={"bits": 4, "quant_method": "gptq"}))
    assert main(["check", "--checkpoint", str(path), "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert "quantization_config has bits 4" in err


@pytest.mark.slow  # a whole check (~30 CPU-seconds); default-lane sibling: test_half_precision_qat_checkpoint_opens_and_is_described
def test_half_precision_qat_checkpoint_passes_the_bf16_check(tiny0_dir, tmp_path):
    from harness.cli import main
    from tests.quant.conftest import SHORT_PROMPTS

    path = _copy(tiny0_dir, tmp_path, lambda c: c.update(_name_or_path="google/gemma-4-12b-it-qat-unquantized"))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(SHORT_PROMPTS))
    assert main(["check", "--checkpoint", str(path), "--tp", "2", "--prompts", str(prompts), "--new-tokens", "4",
                 "--buckets", "16", "--kv-len", "32", "--batch", "1", "--skip-served-build"]) == 0
