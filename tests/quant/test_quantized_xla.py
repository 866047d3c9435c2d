"""`--quantize int8` on the XLA backend (the XLA lane: `bash .ci/xla-lane tests/quant/test_quantized_xla.py`):
the device graphs hold int8 weights and fp32 scales and pass the structural check against the
quantized model; the lowered graph reads the int8 weights (no dequantized constant folded in)."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.parity.check import check_port
from tests.quant.conftest import QUICK

pytestmark = pytest.mark.xla


@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_xla_port_passes_the_structural_check(int8_ckpt, int8_reference, tp):
    engine = build_engine(int8_ckpt, RunSettings(backend="xla", tp=tp, quantize="int8", **QUICK), capture=True)
    weights = engine.backend.weights
    assert weights["layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert weights["layers.0.self_attn.q_proj.scale"].dtype == torch.float32
    result = check_port(int8_ckpt, engine, int8_reference["float32"], int8_reference["bfloat16"])
    assert result.passed and result.fp32 is not None and result.fp32.passed, result.failures()[:3]
