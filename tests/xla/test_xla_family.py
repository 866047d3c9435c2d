"""The Gemma-4 family's tiny variants through the XLA lane: the same per-rank modules (per-layer
inputs, KV-shared attention, router and experts) lowered by torch-xla equal the CPU backend in fp32
at TP 1 and 2, and `check` passes both stages on them there."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.judge.compare import rel_l2
from tests.family.shared import VARIANTS, assert_family_check_passes, family_check, family_checkpoint
from harness.port.decode import generate

pytestmark = pytest.mark.xla
FP32_ROUNDING = 1e-5


@pytest.mark.parametrize("variant, tp", [("31b", 2), ("e2b", 1), ("e2b", 2), ("26b-a4b", 2)])
def test_fp32_xla_equals_cpu_backend(variant, tp):
    ckpt = family_checkpoint(variant)
    from harness.base.settings import RunSettings

    runs = {name: build_engine(ckpt, RunSettings(backend=name, tp=tp, dtype="float32", buckets=(16,), kv_len=32),
                               capture=name == "xla") for name in ("cpu", "xla")}
    prompt = list(range(40, 51))
    out = {name: generate(engine, [prompt], 4, capture=True)[0] for name, engine in runs.items()}
    xla, cpu = out["xla"], out["cpu"]
    assert set(xla.prefill.captures) == set(cpu.prefill.captures)
    for name, value in cpu.prefill.captures.items():
        assert rel_l2(xla.prefill.captures[name], value) < FP32_ROUNDING, name
    assert xla.tokens == cpu.tokens


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_check_passes_both_stages_on_xla(variant, tp):
    """`check --backend xla`: both stages run the lowered graphs (the fp32 stage on xla too) against
    transformers' references; fp32 tokens = transformers', bf16 within the envelope."""
    result = family_check(variant, "xla", tp)
    assert_family_check_passes(result, variant, "xla", tp)
