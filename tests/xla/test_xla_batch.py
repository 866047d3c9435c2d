"""Batches through the device graphs on XLA (issue 29): the batched graphs (seq_ids as an input,
a KV cache of slots) trace and run, a sequence is bit for bit the same whatever its companions,
row and slot, and in a reused slot, and `check --batch` passes on the xla backend."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from tests.parity.batch_support import assert_same_row, batch_engine, random_prompts, run_rows

pytestmark = pytest.mark.xla
STEPS = 2


@pytest.fixture(scope="module")
def xla_be(tiny0_ckpt):
    # small shapes: every (batch bucket, sequence bucket, KV bucket) is a graph XLA compiles; the
    # companions below are 16 tokens, so every run reads the same KV buckets (the same graphs)
    return batch_engine(tiny0_ckpt, batch=2, backend="xla", buckets=(16,), kv_len=32)


def test_xla_rows_are_isolated_and_a_reused_slot_shows_nothing_old(xla_be):
    vocab = xla_be.spec.vocab_size
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


def test_xla_batched_perf_build_returns_each_rows_last_row_as_the_parity_build(xla_be, tiny0_ckpt):
    """The batched perf build (no capture outputs; what `bench --batch` and the served stage run)
    returns each row's last real row only (lm_head on one row per sequence), as the Neuron backend's
    batched perf build: ragged rows (10 and 20 tokens: two prefill calls) give the batched parity
    build's last prefill row, decode steps and KV slots bit for bit."""
    perf = build_engine(tiny0_ckpt, RunSettings(backend="xla", batch=2, buckets=(16,), kv_len=32))
    assert not perf.backend.capture and perf.backend.last_row_only
    prompts = random_prompts(xla_be.spec.vocab_size, (10, 20), seed=5)
    fast, judged = (run_rows(be, prompts, [1, 0], STEPS, capture=be is xla_be) for be in (perf, xla_be))
    for row, (x, y) in enumerate(zip(fast, judged, strict=True)):
        assert x["prefill"].shape[0] == 1 and torch.equal(x["prefill"], y["prefill"][-1:])
        assert not x["captures"] and not any(x["step_caps"])
        assert_same_row({**x, "prefill": y["prefill"]}, {**y, "captures": {}}, f"perf row {row}")
    width = perf.backend.spec.hidden_size
    with pytest.raises(HarnessInputError, match="perf build"):
        perf.backend.forward(torch.zeros(1, 16, width), torch.arange(16)[None], capture=True, seq_ids=[0])


def test_bench_batch_runs_on_xla(tmp_path, capsys):
    """`bench --batch 1,2,4 --backend xla` times the batched perf build: a row per batch size, each
    sequence's tokens those of its prompt alone (row k is prompt k at every batch size)."""
    import json

    from harness.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", "tiny", "--backend", "xla", "--tp", "1", "--batch", "1,2,4", "--runs", "1",
               "--warmup", "0", "--buckets", "16", "--kv-len", "32", "--new-tokens", "3", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    rows = {r["batch"]: r for r in json.loads(out.read_text())["batch"]["rows"]}
    assert sorted(rows) == [1, 2, 4]
    for b, row in rows.items():
        assert len(row["tokens"]) == b and all(len(t) == 3 for t in row["tokens"])
        assert row["step_ms"] > 0 and row["efficiency"] > 0 and row["tokens_per_s"] > 0
    assert rows[4]["tokens"][:2] == rows[2]["tokens"] and rows[2]["tokens"][:1] == rows[1]["tokens"]


@pytest.mark.slow  # the batched check (both stages on xla: every shape compiled), ~15 min on 2 busy cores
def test_a_batch_fault_fails_the_xla_batched_check_naming_the_sequence(monkeypatch):
    from tests.faults.batch_faults import BATCH_CATALOG, named_sequences, run_batch_check

    fault = next(f for f in BATCH_CATALOG if f.name == "batch-kv-write-neighbour-slot")
    result = run_batch_check(fault, monkeypatch, backend="xla")
    assert not result.passed, fault.name
    named = named_sequences(result)
    assert named and named <= set(fault.sequences), (named, result.failures()[:2])
