"""`check --quantize int8` on the family's variants (31B, E2B, E4B, 26B-A4B shapes): the int8 port
passes both stages against each variant's quantized model (MoE routing, per-layer inputs and
KV sharing included: the experts, router and per-layer-input linears stay unquantized)."""

from __future__ import annotations

import pytest

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.inputs.checkpoint import Checkpoint
from harness.inputs.quantized_checkpoint import quantized_reference
from harness.inputs.tiny import TINY_FAMILY, tiny_checkpoint
from harness.parity.check import check_port
from harness.reference.run import run_reference
from tests.quant.conftest import NEW_TOKENS, QUICK, SHORT_PROMPTS


@pytest.mark.slow  # ~8 CPU-seconds a variant; default-lane sibling: tests/quant/test_quantize_composes.py (the 12B shape)
@pytest.mark.parametrize("name", sorted(TINY_FAMILY))
def test_quantized_family_port_passes_the_structural_check(name):
    ckpt = quantized_reference(Checkpoint.open(tiny_checkpoint(seed=0, config_path=TINY_FAMILY[name])), "int8")
    refs = run_reference(ckpt.path, SHORT_PROMPTS, new_tokens=NEW_TOKENS)
    engine = build_engine(ckpt, RunSettings(tp=2, quantize="int8", **QUICK))
    result = check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=False)
    assert result.passed and result.fp32 is not None and result.fp32.passed, result.failures()[:3]
