"""`check --quantize int8` passes on the tiny 12B and every family variant (31B, E2B, E4B, 26B-A4B
shapes: MoE routing, per-layer inputs and KV sharing included) at TP 1 and 2, on the cpu backend and
on the neuron backend through the NxD contract double, through the command itself against the
quantized model's golden (tests/quant/matrix.py). The xla backend's matrix is
tests/quant/test_quantized_xla.py (XLA lane); the faults that make this check fail on the same
models are tests/quant/test_quant_faults.py."""

from __future__ import annotations

import pytest

from tests.quant.matrix import MODELS, assert_passes, check_int8

# About 7 CPU-seconds together with the tiny 12B's golden; the rest of the matrix (~90 CPU-seconds,
# each model's golden once) is the slow lane's, with these two as its default-lane siblings.
DEFAULT_LANE = {("tiny", "cpu", 1), ("tiny", "neuron", 2)}
CASES = [pytest.param(m, b, t, id=f"{m}-{b}-tp{t}", marks=() if (m, b, t) in DEFAULT_LANE else pytest.mark.slow)
         for m in MODELS for b in ("cpu", "neuron") for t in (1, 2)]


@pytest.mark.parametrize("model, backend, tp", CASES)
def test_check_quantize_int8_passes(model, backend, tp, int8_golden, tmp_path, request):
    if backend == "neuron":
        request.getfixturevalue("nxd")
    rc, payload = check_int8(model, backend, tp, int8_golden(model), tmp_path / "check.json")
    assert_passes(rc, payload, backend, tp)
