"""The host memory of `--quantize`'s quantized-model copy (harness/inputs/quantized_checkpoint.py):
written one tensor at a time, counted by the host plan as its own phase ("quantized copy"), and
refused with exit 2 before it is written when that is over the host budget."""

from __future__ import annotations

import math

import pytest
import torch

from harness.inputs import quantized_checkpoint as qc
from harness.plan.host_plan import HOST_FIT, resource_plan


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch, tiny0_ckpt):
    """A cache without the tiny model's quantized copy (the checkpoint itself stays where it is)."""
    monkeypatch.setenv("GEMMA_PARITY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_copy_host_bytes_is_the_largest_tensor_with_its_conversion(tiny0_ckpt, fresh_cache):
    from safetensors import safe_open

    counted = qc.copy_host_bytes(tiny0_ckpt, "int8")
    want = 0
    for file in tiny0_ckpt.weight_files():
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                nbytes = math.prod(t.get_shape()) * (4 if t.get_dtype() == "F32" else 2)
                want = max(want, nbytes + (qc.CONVERT_BYTES * math.prod(t.get_shape()) if qc._quantized(tiny0_ckpt, key) else 0))
    assert counted == want > 0
    qc.quantized_reference(tiny0_ckpt, "int8")
    assert qc.copy_host_bytes(tiny0_ckpt, "int8") == 0  # in the cache: nothing more is written


def test_host_plan_counts_the_quantized_copy_as_a_phase(tiny0_ckpt):
    spec, big = tiny0_ckpt.spec, 64 << 30
    plain = resource_plan(spec, 2, "bfloat16", 32, (16,))
    plan = resource_plan(spec, 2, "bfloat16", 32, (16,), options={"quantized_copy": big})
    for command in ("check", "bisect", "reference"):
        c = plan["commands"][command]
        assert c["host_phases"]["quantized copy"] == big
        base, k, _ = HOST_FIT[command]
        assert c["host_peak_bytes"] == int(base + max(k, 1.0) * big) > plain["commands"][command]["host_peak_bytes"]
    assert "quantized copy" not in plan["commands"]["quality"]["host_phases"]  # quality never writes it


def test_check_over_budget_is_refused_before_the_copy_is_written(tiny0_dir, fresh_cache, capsys):
    from harness.cli import main

    rc = main(["check", "--checkpoint", str(tiny0_dir), "--quantize", "int8", "--host-memory", "0.3", "--tp", "2"])
    assert rc == 2
    assert "writing the quantized model's copy" in capsys.readouterr().err
    assert not list((fresh_cache / "quantized").glob("int8-*"))  # refused before, nothing written


def test_the_copy_is_written_as_the_dequantized_weights(tiny0_ckpt, fresh_cache):
    """The streamed writer's files read back (safetensors) as the quantized model: each quantized
    weight dequantized in fp32, every other tensor as stored."""
    from safetensors.torch import load_file

    from harness.inputs.quantize import dequantize, quantize_weight

    copy = qc.quantized_reference(tiny0_ckpt, "int8")
    for file in tiny0_ckpt.weight_files():
        stored, written = load_file(str(file)), load_file(str(copy.path / file.name))
        assert stored.keys() == written.keys()
        for key, t in stored.items():
            want = dequantize(*quantize_weight(t), torch.float32) if qc._quantized(tiny0_ckpt, key) else t
            assert written[key].dtype == want.dtype and torch.equal(written[key], want), key
