"""Fixtures of the fault catalog: the tiny variant whose embedding scale is inexact in bf16."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def inexact_scale_ckpt(tmp_path_factory):
    """The tiny config at a hidden size whose sqrt is not a bf16 number, built once in tmp."""
    from harness.checkpoint import Checkpoint
    from tests.faults.catalog import inexact_scale_checkpoint

    return Checkpoint.open(inexact_scale_checkpoint(tmp_path_factory.mktemp("inexact-scale")))


@pytest.fixture(scope="session")
def inexact_scale_reference(inexact_scale_ckpt, default_prompts):
    """fp32 and bf16 references of the variant for the default prompts (8 new tokens)."""
    from harness.prompts import DEFAULT_NEW_TOKENS
    from harness.reference import run_reference

    return run_reference(inexact_scale_ckpt.path, default_prompts, new_tokens=DEFAULT_NEW_TOKENS)
