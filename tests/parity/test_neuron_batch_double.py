"""Batches on the neuron backend, through the NxD contract double (tests/nxd_double), issue 29.

A build of N KV slots (--batch N, NxD Inference's max_batch_size) traces every graph of the KV
plan (graphs.kv_graph_plan) at each batch bucket (graphs.batch_buckets: the context-encoding and
token-generation graphs per batch size, as NxD Inference compiles them), taking `seq_ids` (each
row's slot) as an input; a call runs the graph of its rows' bucket. Through the double: the rows
are the CPU backend's bit for bit (so the CPU isolation proofs, tests/parity/test_batch_isolation.py,
hold on these graphs too), `check --batch 4 --backend neuron` with ragged prompts passes, and a
batch fault fails it naming the sequence.
"""

from __future__ import annotations

import pytest
import torch

from harness.backends import neuron, neuron_env
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.port import graphs
from tests.nxd_double import installed
from tests.parity.batch_support import assert_same_row, batch_engine, random_prompts, run_rows

SMALL = {"tp": 2, "dtype": "bfloat16", "buckets": (16,), "kv_len": 32}  # KV buckets 16 and 32


@pytest.fixture
def nxd(tmp_path, monkeypatch):
    """The double on sys.path, a fresh artifact cache, and NeuronCores the core assignment can use."""
    monkeypatch.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "neuron-cache"))
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setattr(neuron_env, "neuron_core_count", lambda: 16)
    with installed(monkeypatch):
        yield tmp_path


def test_a_build_of_slots_traces_every_graph_at_each_batch_bucket():
    """Batch 1 keeps its tags; N slots: each (length, KV bucket) graph once per batch bucket, each
    traced with b rows and b seq_ids."""
    one = neuron.kv_tags((16,), 32)
    assert one == {"prefill_16_kv16": (16, 16), "prefill_16_kv32": (16, 32), "decode_kv16": (1, 16),
                   "decode_kv32": (1, 32)}
    assert neuron.kv_tags((16,), 32, slots=1) == one
    four = neuron.kv_tags((16,), 32, slots=4)
    assert four == {f"{tag}_bs{b}": v for tag, v in one.items() for b in (1, 2, 4)}
    assert set(neuron.kv_tags((16,), 32, slots=3)) == {f"{tag}_bs{b}" for tag in one for b in (1, 2, 3)}
    embeds, positions, seq_ids = graphs.batch_example_inputs(16, 8, neuron.torch.bfloat16, 4)
    assert embeds.shape == (4, 16, 8) and positions.shape == (4, 16) and seq_ids.tolist() == [0, 1, 2, 3]
    assert positions[3].tolist() == list(range(16)) and positions.dtype == graphs.POSITION_DTYPE


@pytest.mark.slow  # 12 graphs traced through the double (~15 s)
def test_neuron_rows_are_the_cpu_backends_bit_for_bit(nxd, tiny0_ckpt):
    """Ragged rows (1, 20 and 7 tokens, the 20 past the largest bucket: two prefill calls) in
    slots 2, 0, 3 with slot 1 a filler, then a reused slot: every row's logits, captures, decode
    steps and KV slot equal the CPU backend's batched run, and each call ran its batch bucket."""
    nb = batch_engine(tiny0_ckpt, 4, backend="neuron", **SMALL)
    cb = batch_engine(tiny0_ckpt, 4, backend="cpu", **SMALL)
    prompts = random_prompts(tiny0_ckpt.spec.vocab_size, (1, 20, 7), seed=1)
    for x, y in zip(run_rows(nb, prompts, [2, 0, 3], 2), run_rows(cb, prompts, [2, 0, 3], 2), strict=True):
        assert_same_row(x, y, "neuron vs cpu")
    assert nb.backend.last_tag == "decode_kv32_bs4"  # 3 rows padded to the bucket of 4
    reused = random_prompts(tiny0_ckpt.spec.vocab_size, (5,), seed=2)
    x = run_rows(nb, reused, [0], 2, fresh=False)[0]  # slot 0 held a 22-position sequence
    assert nb.backend.last_tag == "decode_kv16_bs1"
    assert_same_row(x, run_rows(cb, reused, [0], 2)[0], "neuron reused slot vs cpu fresh")


@pytest.mark.slow  # a small batched build (~8 graphs)
def test_a_call_of_rows_no_bucket_holds_is_refused(nxd, tiny0_ckpt):
    be = neuron.NeuronBackend(tiny0_ckpt, RunSettings(backend="neuron", batch=2, buckets=(16,), kv_len=16),
                              capture=True)
    width = graphs.input_width(be.spec)
    with pytest.raises(HarnessInputError, match=r"3 rows in one call: this build has batch buckets \[1, 2\]"):
        be.forward(neuron.torch.zeros(3, 16, width), neuron.torch.arange(16).expand(3, -1), seq_ids=[0, 1, 0])
    with pytest.raises(HarnessInputError, match=r"seq_ids \[0, 2\]: a slot outside \[0, 2\)"):
        be.forward(neuron.torch.zeros(2, 16, width), neuron.torch.arange(16).expand(2, -1), seq_ids=[0, 2])
    # padded rows written past the 16-row cache (from slot 0's head 0 into its head 1's rows), and a real
    # position past it behind padding: refused on the host, the device cache untouched
    before = [be.kv_cache(layer, rank) for layer in range(be.spec.num_layers) for rank in range(be.tp)]
    tail, filler = list(range(8, 16)) + [-1] * 8, [-1] * 16
    for positions, says in (([tail, filler], "writes cache rows up to 23, past the KV cache length 16"),
                            ([filler, filler[1:] + [20]], "row 1: position 20 is past the KV cache length 16")):
        with pytest.raises(HarnessInputError, match=says):
            be.forward(neuron.torch.ones(2, 16, width), neuron.torch.tensor(positions), seq_ids=[0, 1])
    after = [be.kv_cache(layer, rank) for layer in range(be.spec.num_layers) for rank in range(be.tp)]
    assert all(torch.equal(x, y) for a, b in zip(before, after) for x, y in zip(a, b))
    perf = neuron.NeuronBackend(tiny0_ckpt, RunSettings(backend="neuron", batch=2, buckets=(16,), kv_len=16))
    assert perf.last_row_only  # a batched perf build returns each row's last real row
    with pytest.raises(HarnessInputError, match="perf build"):
        perf.forward(neuron.torch.zeros(2, 16, width), neuron.torch.arange(16).expand(2, -1), capture=True,
                     seq_ids=[0, 1])


@pytest.mark.slow  # a batched perf build and the cpu's (~8 graphs through the double)
def test_the_batched_perf_build_returns_each_rows_last_real_row_as_the_cpu(nxd, tiny0_ckpt):
    """lm_head on one row per sequence: a batched perf build's prefill returns [b, 1, vocab], each
    row's last real position (ragged rows of 5 and 12 tokens), bit for bit the CPU backend's row
    there; decode steps and KV slots equal too."""
    from harness.backends import build_engine
    settings = RunSettings(backend="neuron", batch=2, **SMALL)
    perf = build_engine(tiny0_ckpt, settings)
    prompts = random_prompts(tiny0_ckpt.spec.vocab_size, (5, 12), seed=3)
    width = graphs.input_width(perf.backend.spec)
    positions = neuron.torch.stack([neuron.torch.arange(16), neuron.torch.full((16,), -1)])
    logits, _ = perf.backend.forward(neuron.torch.zeros(2, 16, width), positions, seq_ids=[1, 0])
    assert logits.shape == (2, 1, perf.backend.spec.vocab_size)
    fast = run_rows(perf, prompts, [1, 0], 2, capture=False)
    judged = run_rows(batch_engine(tiny0_ckpt, 2, backend="cpu", **SMALL), prompts, [1, 0], 2)
    for x, y in zip(fast, judged, strict=True):
        assert x["prefill"].shape[0] == 1 and torch.equal(x["prefill"], y["prefill"][-1:])
        assert_same_row({**x, "prefill": y["prefill"]}, {**y, "captures": {}}, "perf vs cpu")


@pytest.mark.slow  # a whole `check --batch 4` (both references, both stages, the served build) through the double
def test_check_batch_4_backend_neuron_with_ragged_prompts_passes(nxd, tmp_path, capsys):
    """tests/parity/test_batch_check_cli.py's ragged prompts (a 1-token prompt, three past the
    largest bucket, five prompts for four slots) served as a batch of 4 on the tiny 12B at TP 2
    through the double: passes, one entry per prompt, the batch note said."""
    from tests.parity.test_batch_check_cli import ragged_prompts, run_check

    rc, payload, _ = run_check(tmp_path, "tiny", 2, "--backend", "neuron")
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert payload["passed"] is True and payload["backend"] == "neuron"
    assert len(payload["prompts"]) == len(ragged_prompts())
    assert any("batch of 4" in n for n in payload["notes"]), payload["notes"]


@pytest.mark.slow  # the batched check through the double (33 graphs), with the fault in its graphs
def test_a_batch_fault_fails_the_neuron_batched_check_naming_the_sequence(nxd, monkeypatch):
    """A KV write into the neighbouring slot (the slot write the graphs do by seq_ids); the other
    batch faults run on cpu (tests/faults/test_batch_faults.py) and were run through the double
    too (batch-pad-keys-visible), each ~2-4 min here."""
    from tests.faults.batch_faults import BATCH_CATALOG, named_sequences, run_batch_check

    fault = next(f for f in BATCH_CATALOG if f.name == "batch-kv-write-neighbour-slot")
    result = run_batch_check(fault, monkeypatch, backend="neuron")
    assert not result.passed, fault.name
    named = named_sequences(result)
    assert named and named <= set(fault.sequences), (fault.name, named, result.failures()[:2])


@pytest.mark.slow  # two small builds (the batch-1 and the batched perf builds) and a timed batch bench
def test_the_device_batch_budgets_path_runs_through_the_double(nxd, tiny0_ckpt):
    """tests/perf/test_device_budgets.py's per-batch path on the tiny 12B through the double: the
    batched perf build benches every batch size (its rows' tokens those of each prompt alone) and
    each gets a budget of BATCH_BUDGET_FACTOR x its floor on the recorded rates, checked on its
    decode steps' median (here the double on a CPU, not inf2: ok-ness is the device's to say)."""
    from harness.perf.batch import BATCH_BUDGET_FACTOR
    from tests.perf.test_device_budgets import batch_budget_checks, device_batch_bench

    settings = RunSettings(backend="neuron", **SMALL)
    result = device_batch_bench(tiny0_ckpt, settings, batches=(1, 2, 4), runs=2, new_tokens=3)
    rows = {r["batch"]: r for r in result["batch"]["rows"]}
    checks = batch_budget_checks(result)
    assert sorted(checks) == sorted(rows) == [1, 2, 4]
    for b, check in checks.items():
        assert check.budget_ms == BATCH_BUDGET_FACTOR * rows[b]["step_floor_ms"] > 0
        assert check.current_median == pytest.approx(rows[b]["step_ms"])
        assert len(rows[b]["tokens"]) == b and all(len(t) == 3 for t in rows[b]["tokens"])
    assert rows[4]["tokens"][:2] == rows[2]["tokens"] and rows[2]["tokens"][:1] == rows[1]["tokens"]
