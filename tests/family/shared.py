"""Tiny transformers-built checkpoints of the Gemma-4 family's variants and their references,
built and computed once per process (each builds in well under a second; the reference run loads
transformers' own class once per variant)."""

from __future__ import annotations

import functools

from tests.faults.catalog import FAMILY_NEW_TOKENS, FAMILY_PROMPTS

VARIANTS = ("31b", "e2b", "e4b", "26b-a4b")


@functools.lru_cache(maxsize=None)
def family_checkpoint(variant: str):
    from harness.checkpoint import Checkpoint
    from harness.tiny import TINY_FAMILY, tiny_checkpoint

    return Checkpoint.open(tiny_checkpoint(0, TINY_FAMILY[variant]))


@functools.lru_cache(maxsize=None)
def family_reference(variant: str):
    """fp32 and bf16 references of the family prompts (bf16 teacher-forced on the fp32 tokens)."""
    from harness.reference import run_reference

    return run_reference(family_checkpoint(variant).path, FAMILY_PROMPTS, FAMILY_NEW_TOKENS)
