"""Batches through the device graphs on XLA (issue 29): the batched graphs (seq_ids as an input,
a KV cache of slots) trace and run, a sequence is bit for bit the same whatever its companions,
row and slot, and in a reused slot, and `check --batch` passes on the xla backend."""

from __future__ import annotations

import pytest

from harness.base.errors import HarnessInputError
from tests.parity.batch_support import assert_same_row, batch_engine, random_prompts, run_rows

pytestmark = pytest.mark.xla
STEPS = 2


@pytest.fixture(scope="module")
def xla_be(tiny0_ckpt):
    # small shapes: every (batch bucket, sequence bucket, KV bucket) is a graph XLA compiles; the
    # companions below are 16 tokens, so every run reads the same KV buckets (the same graphs)
    return batch_engine(tiny0_ckpt, batch=2, backend="xla", buckets=(16,), kv_len=32)


def test_xla_rows_are_isolated_and_a_reused_slot_shows_nothing_old(xla_be):
    vocab = xla_be.engine.spec.vocab_size
    target = random_prompts(vocab, [10], seed=7)[0]
    base = run_rows(xla_be, [target, *random_prompts(vocab, (16,), seed=1)], [0, 1], STEPS)[0]
    moved = run_rows(xla_be, [*random_prompts(vocab, (16,), seed=2), target], [0, 1], STEPS)[1]
    assert_same_row(base, moved, "xla: companion, row and slot")
    run_rows(xla_be, random_prompts(vocab, (20,), seed=3), [0], STEPS)  # slot 0 left holding 22 positions
    reused = run_rows(xla_be, [target, *random_prompts(vocab, (16,), seed=4)], [0, 1], STEPS, fresh=False)[0]
    assert_same_row(base, reused, "xla: reused slot")


@pytest.mark.slow
def test_xla_batched_check_passes(tiny0_ckpt, tiny0_reference):
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port

    engine = build_engine(tiny0_ckpt, RunSettings(backend="xla", batch=4, buckets=(64, 256), kv_len=288), capture=True)
    result = check_port(tiny0_ckpt, engine, tiny0_reference["float32"], tiny0_reference["bfloat16"], local=False)
    assert result.passed, result.failures()
    assert result.fp32 is not None and result.fp32.passed and result.fp32.backend == "xla"


def test_xla_batched_perf_build_is_refused(tiny0_ckpt):
    from harness.backends import build_engine
    from harness.base.settings import RunSettings

    with pytest.raises(HarnessInputError, match="--batch 2"):
        build_engine(tiny0_ckpt, RunSettings(backend="xla", batch=2, buckets=(16,), kv_len=32))


@pytest.mark.slow  # the batched check (both stages on xla: every shape compiled), ~15 min on 2 busy cores
def test_a_batch_fault_fails_the_xla_batched_check_naming_the_sequence(monkeypatch):
    from tests.faults.batch_faults import BATCH_CATALOG, named_sequences, run_batch_check

    fault = next(f for f in BATCH_CATALOG if f.name == "batch-kv-write-neighbour-slot")
    result = run_batch_check(fault, monkeypatch, backend="xla")
    assert not result.passed, fault.name
    named = named_sequences(result)
    assert named and named <= set(fault.sequences), (named, result.failures()[:2])
