"""Fixtures of the quantization suite: the tiny 12B's quantized model (its structural reference)
and its references on two short prompts, computed once per session."""

from __future__ import annotations

import pytest

SHORT_PROMPTS = [[2, 17, 33, 4, 9, 71, 5], [2, 8, 100, 42, 7, 13, 3, 88, 21, 6, 11]]
NEW_TOKENS = 4
QUICK = {"buckets": (16,), "kv_len": 32}  # settings that hold SHORT_PROMPTS and NEW_TOKENS


@pytest.fixture(scope="session")
def int8_ckpt(tiny0_ckpt):
    from harness.inputs.quantized_checkpoint import quantized_reference

    return quantized_reference(tiny0_ckpt, "int8")


@pytest.fixture(scope="session")
def int8_reference(int8_ckpt):
    from harness.reference.run import run_reference

    return run_reference(int8_ckpt.path, SHORT_PROMPTS, new_tokens=NEW_TOKENS)
