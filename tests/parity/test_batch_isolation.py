"""Isolation of the sequences of a batch, bit for bit (issue 29): on the same backend, graphs and
shapes, a sequence's logits, captures and KV slot are identical whatever its companions hold
(random prompts, other lengths, empty slots), wherever its row and slot are, and whether its slot
is fresh or was left by a finished sequence. Removing the per-row mask makes them fail."""

from __future__ import annotations

import pytest
import torch

from harness.port import model as port_model
from tests.parity.batch_support import assert_same_row, batch_engine, random_prompts, run_rows

STEPS = 3
TARGET_LEN = 20  # in the 64 bucket, like every companion below: the same graph in every run


@pytest.fixture(scope="module")
def be(tiny0_ckpt):
    return batch_engine(tiny0_ckpt, batch=4)


@pytest.fixture(scope="module")
def target(tiny0_ckpt):
    return random_prompts(tiny0_ckpt.spec.vocab_size, [TARGET_LEN], seed=7)[0]


def companions(be, lengths, seed):
    return random_prompts(be.spec.vocab_size, lengths, seed)


def test_a_row_is_the_same_whatever_its_companions_and_row(be, target):
    """Random companions of other lengths (a 1-token prompt, one longer than the target, one of
    the whole bucket), the target in another row and slot, and an empty slot (a filler row)."""
    base = run_rows(be, [target, *companions(be, (1, 64, 33), seed=1)], [0, 1, 2, 3], STEPS)[0]
    other = run_rows(be, [*companions(be, (40, 2), seed=2), target, *companions(be, (9,), seed=3)], [3, 1, 2, 0], STEPS)[2]
    assert_same_row(base, other, "companions and row")
    with_empty = run_rows(be, [companions(be, (50,), seed=4)[0], target, companions(be, (5,), seed=5)[0]],
                          [1, 3, 0], STEPS)[1]
    assert_same_row(base, with_empty, "an empty slot beside it")


def test_every_row_is_the_same_under_a_permutation_of_the_rows(be, target):
    prompts = [target, *companions(be, (1, 64, 33), seed=1)]
    slots = [0, 1, 2, 3]
    base = run_rows(be, prompts, slots, STEPS)
    order = [2, 0, 3, 1]
    permuted = run_rows(be, [prompts[i] for i in order], [slots[i] for i in order], STEPS)
    for row, i in enumerate(order):
        assert_same_row(base[i], permuted[row], f"row {i} moved to row {row}")


def reuse_and_fresh(be, target):
    """The target started in slot 2 after an 80-token sequence decoded there (no reset; slot 0
    keeps its sequence), and in a fresh cache; in row 1 beside a 70-token companion in row 0 (the
    old keys past the target's padded chunk are what a mask not by its own positions would show)."""
    run_rows(be, companions(be, (80, 30), seed=8), [2, 0], STEPS)
    reused = run_rows(be, [companions(be, (70,), seed=9)[0], target], [1, 2], STEPS, fresh=False)[1]
    fresh = run_rows(be, [companions(be, (70,), seed=10)[0], target], [1, 2], STEPS)[1]
    return reused, fresh


def test_a_sequence_in_a_reused_slot_is_the_same_as_in_a_fresh_cache(be, target):
    assert_same_row(*reuse_and_fresh(be, target), "reused slot")


def _mask_from_row0(monkeypatch):
    """The fault the proof must catch: every row masked by row 0's positions."""
    original = port_model.attention_mask
    monkeypatch.setattr(port_model, "attention_mask", lambda positions, keys, window, dtype: original(
        positions[:1].expand_as(positions), keys[:1].expand_as(keys) if torch.is_tensor(keys) and keys.dim() == 2 else keys,
        window, dtype))


def test_the_isolation_tests_fail_without_the_per_row_mask(be, target, monkeypatch):
    _mask_from_row0(monkeypatch)
    with pytest.raises(AssertionError):
        test_a_row_is_the_same_whatever_its_companions_and_row(be, target)
    with pytest.raises(AssertionError):
        test_every_row_is_the_same_under_a_permutation_of_the_rows(be, target)
    with pytest.raises(AssertionError, match="differ"):  # the previous occupant's keys seen
        assert_same_row(*reuse_and_fresh(be, target), "reused slot")


@pytest.fixture(scope="module")
def ring_be(long_ckpt):
    from tests.faults.catalog import LONG_BUCKETS, LONG_KV_LEN

    return batch_engine(long_ckpt, batch=3, buckets=LONG_BUCKETS, kv_len=LONG_KV_LEN, sliding_cache="ring")


def test_ring_cache_rows_are_isolated_and_a_reused_ring_slot_shows_nothing_old(ring_be):
    """Window 8, a ring per slot: a 20-token target prefilled in chunks of 12 and decoded past the
    window beside companions of other lengths, in another row and slot, and in a reused slot."""
    vocab = ring_be.spec.vocab_size
    target = random_prompts(vocab, [20], seed=11)[0]
    base = run_rows(ring_be, [target, *random_prompts(vocab, (30, 1), seed=12)], [0, 1, 2], STEPS + 6)[0]
    moved = run_rows(ring_be, [*random_prompts(vocab, (17,), seed=13), target], [0, 2], STEPS + 6)[1]
    assert_same_row(base, moved, "ring: companions, row and slot")
    run_rows(ring_be, random_prompts(vocab, (35, 9), seed=14), [1, 0], STEPS)
    reused = run_rows(ring_be, [target, *random_prompts(vocab, (30, 1), seed=15)], [1, 0, 2], STEPS + 6,
                      fresh=False)[0]
    assert_same_row(base, reused, "ring: reused slot")


@pytest.mark.parametrize("variant", ["e2b", "26b-a4b"])
def test_family_rows_are_isolated_per_layer_inputs_routing_and_shared_kv(variant):
    """E2B: per-layer inputs per row and KV-shared layers reading their source's slot; 26B-A4B:
    routing per row. A row is identical beside other companions, in another row and slot."""
    from tests.family.shared import family_checkpoint

    be = batch_engine(family_checkpoint(variant), batch=3, buckets=(64,), kv_len=128)
    vocab = be.spec.vocab_size
    target = random_prompts(vocab, [15], seed=21)[0]
    base = run_rows(be, [target, *random_prompts(vocab, (40, 1), seed=22)], [0, 1, 2], STEPS)[0]
    moved = run_rows(be, [*random_prompts(vocab, (64, 3), seed=23), target], [2, 0, 1], STEPS)[2]
    assert_same_row(base, moved, f"{variant}: companions, row and slot")
    assert any("per_layer_input" in k or "router_logits" in k for k in base["captures"])
