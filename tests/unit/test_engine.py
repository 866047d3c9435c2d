"""Host side of the port: bucket choice, the embedding scale cast to the weight dtype, multimodal
placeholder ids swapped for pad before embedding, prompt validation, and the host softcap."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.base.errors import PromptError
from harness.port.engine import Engine, choose_bucket, chunk_plan, chunk_positions, embed_scale, softcap

BUCKETS = (16, 64, 128)


@pytest.mark.parametrize("length,bucket", [(1, 16), (15, 16), (16, 16), (17, 64), (64, 64), (65, 128), (128, 128)])
def test_choose_bucket_picks_the_smallest_that_holds(length, bucket):
    """A prompt goes to the smallest bucket that holds it; exactly a bucket's size uses that bucket."""
    assert choose_bucket(length, BUCKETS) == bucket
    assert choose_bucket(length, tuple(reversed(BUCKETS))) == bucket


@given(length=st.integers(1, 300), buckets=st.sets(st.integers(1, 300), min_size=1, max_size=5))
def test_choose_bucket_property(length, buckets):
    """Whenever some bucket holds the prompt, the chosen one holds it and no smaller bucket does;
    when none does, the prompt is refused."""
    if length > max(buckets):
        with pytest.raises(PromptError):
            choose_bucket(length, buckets)
        return
    chosen = choose_bucket(length, buckets)
    assert chosen in buckets and chosen >= length
    assert not any(length <= b < chosen for b in buckets)


@given(n=st.integers(1, 200), buckets=st.sets(st.integers(1, 64), min_size=1, max_size=4), room=st.integers(0, 40))
def test_chunk_plan_property(n, buckets, room):
    """Chunks cover the prompt in order without overlap, each through a bucket of the build (or the
    decode graph, 1) that holds it, no padded slot past the KV length, and a prompt that fits one
    bucket is one chunk of the smallest such bucket."""
    kv_len = max(n, max(buckets)) + room
    plan = chunk_plan(n, buckets, kv_len)
    assert [start for start, _, _ in plan] == [sum(length for _, length, _ in plan[:k]) for k in range(len(plan))]
    assert sum(length for _, length, _ in plan) == n
    for start, length, bucket in plan:
        assert bucket in set(buckets) | {1} and 1 <= length <= bucket and start + bucket <= kv_len
    if any(b >= n for b in buckets):
        assert plan == [(0, n, choose_bucket(n, buckets))]
    with pytest.raises(PromptError, match="longer than the KV length"):
        chunk_plan(kv_len + 1, buckets, kv_len)


def test_chunk_positions_pad_with_minus_one():
    assert chunk_positions(12, 3, 5).tolist() == [[12, 13, 14, -1, -1]]


def test_prompt_longer_than_the_largest_bucket_is_refused():
    """The error names the length, the largest bucket and the option to change."""
    with pytest.raises(PromptError, match=r"129 tokens.*\(128\).*--buckets"):
        choose_bucket(129, BUCKETS)


def test_embed_scale_is_cast_to_the_weight_dtype():
    """sqrt(hidden) is rounded to the weight dtype before multiplying: in bf16 sqrt(3840) = 61.97
    becomes 62.0 (docs/design.md#the-model-facts-and-traps, trap 7); in fp32 it stays 61.97."""
    bf16 = embed_scale(3840, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and float(bf16) == 62.0
    fp32 = embed_scale(3840, torch.float32)
    assert fp32.dtype == torch.float32 and math.isclose(float(fp32), math.sqrt(3840), rel_tol=1e-7)


def test_engine_embeds_with_the_cast_scale(tiny0_ckpt):
    """At the 12B's width in bf16 the engine's embedding is E[ids] * 62.0, which differs from
    scaling by the unrounded 61.97."""
    spec = replace(tiny0_ckpt.spec, hidden_size=3840)
    weight = torch.randn(spec.vocab_size, 3840, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    engine = Engine(spec, backend=None, embed_weight=weight)
    ids = torch.tensor([3, 17, 400])
    got = engine.embed(ids)[0]
    assert torch.equal(got, weight[ids] * torch.tensor(62.0, dtype=torch.bfloat16))
    unrounded = (weight[ids].float() * math.sqrt(3840)).to(torch.bfloat16)
    assert not torch.equal(got, unrounded)


@pytest.fixture(scope="module")
def tiny_engine(tiny0_ckpt):
    """An engine over the tiny model's embeddings; the host-side tests never reach the backend."""
    return Engine(tiny0_ckpt.spec, backend=None, embed_weight=tiny0_ckpt.embed_weight(torch.bfloat16))


def test_placeholder_ids_embed_as_pad(tiny_engine):
    """Each multimodal placeholder id (image, video, audio) is accepted and embeds exactly as the
    pad id does, as the multimodal wrapper swaps them before embedding."""
    spec = tiny_engine.spec
    assert len(spec.placeholder_token_ids) == 3
    with_pad = tiny_engine.embed(tiny_engine.validate_ids([5, spec.pad_token_id, 9]))
    for placeholder in spec.placeholder_token_ids:
        assert placeholder >= spec.vocab_size  # outside the text vocabulary: must never be looked up
        ids = tiny_engine.validate_ids([5, placeholder, 9])
        assert torch.equal(tiny_engine.embed(ids), with_pad)
    assert not torch.equal(with_pad[0, 1], tiny_engine.embed(torch.tensor([5]))[0, 0])


@pytest.mark.parametrize("ids,message", [([], "empty prompt"), ([1, 2, 512], r"token id 512 at position 2"),
                                         ([-1], r"token id -1 at position 0")])
def test_bad_prompt_ids_are_refused(tiny_engine, ids, message):
    """Empty prompts and ids outside [0, vocab) (placeholders aside) are PromptErrors."""
    with pytest.raises(PromptError, match=message):
        tiny_engine.validate_ids(ids)


def test_softcap_is_30_tanh_x_over_30():
    """softcap(x, 30) = 30 * tanh(x / 30) in fp32, including where it saturates; no cap is identity."""
    x = torch.cat([torch.linspace(-400, 400, 2001), torch.randn(1000) * 50])
    expected = (30 * torch.tanh(x.double() / 30)).float()
    torch.testing.assert_close(softcap(x, 30.0), expected, rtol=2e-7, atol=4e-6)
    assert softcap(x, 30.0).abs().max() <= 30.0
    assert torch.equal(softcap(x, None), x)


def test_softcap_computes_in_fp32_from_bf16_logits():
    """bf16 raw logits are capped in fp32, not in bf16 (where 30 * tanh saturates far earlier)."""
    x = torch.linspace(-120, 120, 481).to(torch.bfloat16)
    got = softcap(x, 30.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (30 * torch.tanh(x.double() / 30)).float(), rtol=2e-7, atol=4e-6)
