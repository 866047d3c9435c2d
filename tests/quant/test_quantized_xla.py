"""`--quantize int8` on the XLA backend (the XLA lane: `bash .ci/xla-lane tests/quant/test_quantized_xla.py`):
the device graphs hold int8 weights and fp32 scales, and `check --quantize int8` passes both stages
against the quantized model on the tiny 12B and every family variant at TP 1 and 2, through the
command itself (tests/quant/matrix.py; the cpu and neuron-double matrix is test_quantized_matrix.py).
The 26B-A4B MoE at TP 2 runs in the lane's serial part (.ci/xla-lane SERIAL: its TP 2 all-reduce
rendezvous beside another worker's graphs)."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.settings import RunSettings
from tests.quant.conftest import QUICK
from tests.quant.matrix import MODELS, assert_passes, check_int8

pytestmark = pytest.mark.xla


def test_xla_graphs_hold_int8_weights_and_fp32_scales(int8_ckpt):
    weights = build_engine(int8_ckpt, RunSettings(backend="xla", tp=2, quantize="int8", **QUICK), capture=True).backend.weights
    assert weights["layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert weights["layers.0.self_attn.q_proj.scale"].dtype == torch.float32
    assert weights["lm_head.weight"].dtype == torch.bfloat16  # the scheme keeps it


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", MODELS)
def test_check_quantize_int8_passes_on_xla(model, tp, int8_golden, tmp_path):
    rc, payload = check_int8(model, "xla", tp, int8_golden(model), tmp_path / "check.json")
    assert_passes(rc, payload, "xla", tp)
