"""The fp32 stage's envelope reference (harness/reference/float64.py): transformers in float64 along the
fp32 reference's path, laid out as the fp32 reference (prefill rows, decode steps as rows of one
teacher-forced sequence, KV rows), whole or streamed one layer at a time, the same numbers either way;
and its distance from the fp32 reference is fp32-sized, far below bf16's."""

from __future__ import annotations

import pytest
import torch

from harness.judge.compare import rel_l2
from harness.reference import float64 as reference64
from tests.census.ports import Shape, checkpoint, prompt_of, references

# hidden 72: sqrt(72) is inexact, so a scale rounded to fp32 anywhere in the float64 path shows
SHAPE = Shape("ref64", "builder", (("hidden_size", 72),))
PROMPTS, NEW = (prompt_of(8), prompt_of(3)), 4


@pytest.fixture(scope="module")
def whole_and_streamed():
    ckpt = checkpoint(SHAPE)
    ref32 = references(SHAPE, PROMPTS, NEW)["float32"]
    whole = reference64.float64_references(ckpt, ref32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference64, "FLOAT64_RESIDENT_BYTES", 0)  # force the streamed path
        streamed = reference64.float64_references(ckpt, ref32)
    return ref32, whole, streamed


def test_float64_reference_has_the_fp32_references_layout(whole_and_streamed):
    ref32, whole, streamed = whole_and_streamed
    for r32, w, s in zip(ref32, whole, streamed):
        for name, t in r32.captures.items():
            assert w.captures[name].shape == t.shape, name
            assert s.captures[name].shape == t.shape, name
        assert w.step_logits.shape == r32.step_logits.shape == s.step_logits.shape


def test_streamed_equals_whole(whole_and_streamed):
    _, whole, streamed = whole_and_streamed
    for w, s in zip(whole, streamed):
        for name, t in w.captures.items():
            assert rel_l2(s.captures[name], t) < 1e-6, name  # captures are stored as fp32
        assert rel_l2(s.step_logits, w.step_logits) < 1e-6


def test_the_streamed_float64_embedding_scale_is_float64():
    """transformers loads a float64 model with float64 embedding-scale buffers: the streamed pass
    must too (sqrt(72) rounded to fp32 is an fp32-sized error inside the float64 envelope, below
    what the fp32-stored captures above can show)."""
    from harness.reference.run import hf_decoder_parts
    from harness.reference.stream import _scaled_embedding

    ckpt = checkpoint(SHAPE)
    emb = _scaled_embedding(hf_decoder_parts(ckpt.spec), ckpt.embed_weight(torch.float64), ckpt.spec)
    assert emb.embed_scale.dtype == torch.float64 and float(emb.embed_scale) == 72 ** 0.5


def test_fp32_reference_is_fp32_close_to_float64_and_bf16_is_not(whole_and_streamed):
    ref32, whole, _ = whole_and_streamed
    ref16 = references(SHAPE, PROMPTS, NEW)["bfloat16"]
    name = "layers.11.output"
    fp32_err = max(rel_l2(r.captures[name], w.captures[name]) for r, w in zip(ref32, whole))
    bf16_err = max(rel_l2(r.captures[name], w.captures[name]) for r, w in zip(ref16, whole))
    assert 0 < fp32_err < 1e-5 < 1e-3 < bf16_err
    steps = torch.cat([r.step_logits for r in ref32])
    assert rel_l2(steps, torch.cat([w.step_logits for w in whole])) < 1e-5
