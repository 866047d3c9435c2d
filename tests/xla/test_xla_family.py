"""The Gemma-4 family's tiny variants through the XLA lane: the same per-rank modules (per-layer
inputs, KV-shared attention, router and experts) lowered by torch-xla equal the CPU backend in fp32
at TP 1 and 2, and `check` passes both stages on them there."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.compare import rel_l2
from tests.family.shared import VARIANTS, assert_family_check_passes, family_check, family_checkpoint

pytestmark = pytest.mark.xla
FP32_ROUNDING = 1e-5


@pytest.mark.parametrize("variant, tp", [("31b", 2), ("e2b", 1), ("e2b", 2), ("26b-a4b", 2)])
def test_fp32_xla_equals_cpu_backend(variant, tp):
    ckpt = family_checkpoint(variant)
    from harness.settings import RunSettings

    runs = {name: build_engine(ckpt, RunSettings(backend=name, tp=tp, dtype="float32", buckets=(16,), kv_len=32),
                               capture=name == "xla") for name in ("cpu", "xla")}
    prompt = list(range(40, 51))
    out = {name: engine.generate(prompt, 4, capture=True) for name, engine in runs.items()}
    xla, cpu = out["xla"], out["cpu"]
    assert set(xla.prefill.captures) == set(cpu.prefill.captures)
    for name, value in cpu.prefill.captures.items():
        assert rel_l2(xla.prefill.captures[name], value) < FP32_ROUNDING, name
    assert xla.tokens == cpu.tokens


# A known gap of the fp32 judge on xla, not a port bug (README, "The Gemma-4 family"): the tiny E4B's
# fp32 stage fails at one gated per-layer input each, 16.6x and 16.8x its limit of 16. The port runs
# transformers' gelu_pytorch_tanh, 0.5 x (1 + tanh u); XLA's CPU tanh is off by 2e-7 (PyTorch's by
# 3e-8), 1 + tanh u cancels for u << 0, and the gated row is RMS-normalised after its projection, so
# the difference reaches those rows. The same function written x * sigmoid(2u) (no cancellation)
# passes on xla (5.9x) but fails on cpu at TP 2 at the same decode row (18.4x): the fp32 reference
# itself carries that cancellation, and the judge's fp32 envelope (the bf16 one scaled by 2^-16; bf16
# gelu rounds once, from fp32) is tighter there than the reference's own error. The exact points
# are asserted, so the test fails when the gap moves or closes.
FP32_JUDGE_GAP = {("e4b", 1): frozenset({"layers.11.per_layer_input"}),
                  ("e4b", 2): frozenset({"decode.layers.9.per_layer_input"})}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_check_passes_both_stages_on_xla(variant, tp):
    """`check --backend xla`: both stages run the lowered graphs (the fp32 stage on xla too) against
    transformers' references; fp32 tokens = transformers', bf16 within the envelope."""
    result = family_check(variant, "xla", tp)
    assert_family_check_passes(result, variant, "xla", tp, fp32_gap=FP32_JUDGE_GAP.get((variant, tp), frozenset()))
