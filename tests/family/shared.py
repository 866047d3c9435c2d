"""Tiny transformers-built checkpoints of the Gemma-4 family's variants and their references,
built and computed once per process (each builds in well under a second; the reference run loads
transformers' own class once per variant)."""

from __future__ import annotations

import functools

from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_KV_LEN, FAMILY_NEW_TOKENS, FAMILY_PROMPTS

VARIANTS = ("31b", "e2b", "e4b", "26b-a4b")


@functools.lru_cache(maxsize=None)
def family_checkpoint(variant: str):
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_FAMILY, TINY_UNIFIED_KV, tiny_checkpoint

    return Checkpoint.open(tiny_checkpoint(0, TINY_UNIFIED_KV if variant == "unified-kv" else TINY_FAMILY[variant]))


@functools.lru_cache(maxsize=None)
def family_reference(variant: str):
    """fp32 and bf16 references of the family prompts (bf16 teacher-forced on the fp32 tokens)."""
    from harness.reference.run import run_reference

    return run_reference(family_checkpoint(variant).path, FAMILY_PROMPTS, FAMILY_NEW_TOKENS)


def family_check(variant: str, backend: str, tp: int):
    """`check` (both stages, no local verdicts) of the port in bf16 on `backend` at `tp`, on the
    variant's tiny checkpoint against its references."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port

    ckpt, refs = family_checkpoint(variant), family_reference(variant)
    settings = RunSettings(backend=backend, tp=tp, dtype="bfloat16", buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN)
    engine = build_engine(ckpt, settings, capture=True)
    return check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=False)


def assert_family_check_passes(result, variant: str, backend: str, tp: int) -> None:
    """The fp32 stage ran on the backend itself at its TP and equals transformers token for token;
    the bf16 stage passes (on the MoE variant with routing teacher-forced, harness/judge/routing.py)."""
    fp32 = result.fp32
    assert fp32 is not None and (fp32.backend, fp32.tp, fp32.dtype) == (backend, tp, "float32")
    assert fp32.passed and fp32.seq_match, fp32.failures()
    assert [p.device_tokens for p in fp32.prompts] == [r.generated for r in family_reference(variant)["float32"]]
    assert (result.backend, result.tp, result.dtype) == (backend, tp, "bfloat16")
    assert result.passed, result.failures()
