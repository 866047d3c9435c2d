"""Faults only a batch has (tests/faults/batch_faults.py): `check --batch` fails on each, naming
a sequence the fault broke; the clean port passes the same batched check."""

from __future__ import annotations

import pytest

from tests.faults.batch_faults import BATCH_CATALOG, named_sequences, run_batch_check


@pytest.mark.parametrize("variant", [None, pytest.param("e2b", marks=pytest.mark.slow),
                                     pytest.param("26b-a4b", marks=pytest.mark.slow)])
def test_clean_port_passes_the_batched_check(monkeypatch, variant):
    result = run_batch_check(None, monkeypatch, variant)
    assert result.fp32.passed, result.fp32.failures()
    assert result.passed and result.bf16.divergences == 0, result.failures()
    assert any("batch of" in n for n in result.notes)


# the rest: the slow lane (the reused slot's in the default lane through the default check's batch
# stage, tests/parity/test_batch_stage.py)
DEFAULT_LANE = ("batch-pad-keys-visible",)


@pytest.mark.parametrize("fault", [pytest.param(f, marks=() if f.name in DEFAULT_LANE else pytest.mark.slow)
                                   for f in BATCH_CATALOG], ids=lambda f: f.name)
def test_batch_fault_fails_check_naming_the_sequence(monkeypatch, fault):
    result = run_batch_check(fault, monkeypatch)
    assert not result.passed, fault.name
    named = named_sequences(result)
    assert named and named <= set(fault.sequences), (fault.name, named, result.failures()[:2])


@pytest.mark.slow
def test_bisect_names_the_sequence_of_a_batch_fault(monkeypatch):
    """bisect --batch (capture mode) of the neighbouring-slot write: its check fails naming a sequence,
    and its first failing point's worst row is located in a sequence (worst_prompt)."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import tiny_checkpoint
    from harness.parity.bisect import bisect_capture
    from tests.faults.batch_faults import BATCH_BUCKETS, BATCH_KV_LEN, BATCH_SLOTS, batch_reference

    fault = next(f for f in BATCH_CATALOG if f.name == "batch-kv-write-neighbour-slot")
    fault.inject(monkeypatch)
    ckpt, refs = Checkpoint.open(tiny_checkpoint(seed=0)), batch_reference()
    engine = build_engine(ckpt, RunSettings(batch=BATCH_SLOTS, buckets=BATCH_BUCKETS, kv_len=BATCH_KV_LEN), capture=True)
    result = bisect_capture(ckpt, engine, (refs["float32"], refs["bfloat16"]))
    assert not result.check.passed
    assert named_sequences(result.check) <= set(fault.sequences)
    layers = result.to_json()["layers"]
    located = [p["worst_prompt"] for layer in layers for p in layer["cumulative_points"] if "worst_prompt" in p]
    assert located and set(located) <= set(range(len(refs["float32"])))
