"""The XLA backend: the device graphs through torch-xla on CPU compute what the CPU backend
computes (fp32: to rounding, at TP=1 and TP=2 with in-graph collectives), carry the KV cache
between calls, take only the planned lengths, and pass `check` on the tiny model and on a
checkpoint of other widths and layer pattern."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.inputs.checkpoint import Checkpoint
from harness.judge.compare import rel_l2
from harness.port.decode import generate

pytestmark = pytest.mark.xla
FP32_ROUNDING = 1e-5  # relative L2 of fp32 computations that differ only in summation order


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_xla_equals_cpu_backend_prefill_and_decode(tiny0_ckpt, tp):
    """Same sharded weights, same graph: the XLA run equals the CPU backend's to fp32 rounding at
    every capture point and at every decode step (the cache persisted between calls). At TP=2 a
    missing or wrong all-reduce/all-gather would be off by O(1)."""
    runs = {name: build_engine(tiny0_ckpt, RunSettings(backend=name, tp=tp, dtype="float32", buckets=(16,), kv_len=32),
                               capture=name == "xla") for name in ("cpu", "xla")}
    prompt = list(range(40, 51))
    out = {name: generate(engine, [prompt], 6, capture=True)[0] for name, engine in runs.items()}
    xla, cpu = out["xla"], out["cpu"]
    assert set(xla.prefill.captures) == set(cpu.prefill.captures)
    for name, value in cpu.prefill.captures.items():
        assert rel_l2(xla.prefill.captures[name], value) < FP32_ROUNDING, name
    assert rel_l2(xla.step_logits, cpu.step_logits) < FP32_ROUNDING
    assert xla.tokens == cpu.tokens


def test_tp2_kv_cache_holds_each_ranks_own_heads(tiny0_ckpt):
    """After a prefill, rank r's cache of a sliding layer holds rank r's KV heads (they differ
    between ranks); the full layer's single replicated head is the same on both."""
    engine = build_engine(tiny0_ckpt, RunSettings(backend="xla", dtype="float32", buckets=(16,), kv_len=32))
    engine.prefill(list(range(3, 19)))
    backend = engine.backend
    sliding = [k.float() for k, _ in (backend.kv_cache(0, r) for r in range(2))]
    full = [k.float() for k, _ in (backend.kv_cache(5, r) for r in range(2))]
    assert sliding[0][0, :, :16].abs().sum() > 0 and (sliding[0][:, :, :16] - sliding[1][:, :, :16]).abs().max() > 1e-3
    assert torch.equal(full[0], full[1]) and full[0][0, :, 16:].abs().sum() == 0  # unwritten slots stay zero


def test_only_planned_lengths_run(tiny0_ckpt):
    engine = build_engine(tiny0_ckpt, RunSettings(backend="xla", tp=1, buckets=(16,), kv_len=32))
    x = torch.zeros(1, 5, tiny0_ckpt.spec.hidden_size)
    with pytest.raises(HarnessInputError, match="no compiled graph takes 5 positions"):
        engine.backend.forward(x, torch.arange(5)[None])


def _check(ckpt_dir, capsys):
    from harness.cli import main

    code = main(["check", "--backend", "xla", "--checkpoint", str(ckpt_dir), "--tp", "2"])
    return code, capsys.readouterr().out


def test_check_passes_on_the_tiny_model(tiny0_dir, capsys):
    code, out = _check(tiny0_dir, capsys)
    assert code == 0, out
    assert "backend=xla tp=2" in out and "PARITY PASS" in out


def test_check_passes_on_a_checkpoint_of_other_widths_and_pattern(variant_dir, capsys):
    ckpt = Checkpoint.open(variant_dir)
    assert ckpt.spec.hidden_size == 96 and [layer.type for layer in ckpt.spec.layers][:2] == [
        "sliding_attention", "full_attention"]
    code, out = _check(variant_dir, capsys)
    assert code == 0, out
    table = [line.split() for line in out.splitlines() if line[:1].isdigit() and ("sliding" in line or "full" in line)]
    assert len(table) == 5 and all(row[-1] == "pass" for row in table), out


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_graph_on_its_own_shards_meets_the_contracts(tiny0_ckpt, rank):
    """Every TP=2 rank's graph, lowered on that rank's shards from the checkpoint, traces with the
    plan's per-rank shapes and its collectives, and meets every contract."""
    from harness.backends.xla import XlaBackend
    from harness.hlo.contracts import GraphSignature, check_graph
    from harness.hlo.expectation import expectation_for

    backend = XlaBackend(tiny0_ckpt, RunSettings(backend="xla", buckets=(16,), kv_len=32))
    graphs = backend.lower_graphs(rank=rank)
    assert sorted(graphs) == ["decode", "prefill_16"]
    for tag, graph in graphs.items():
        sig = GraphSignature(graph.params, graph.outputs, graph.host_transfers)
        exp = expectation_for(tiny0_ckpt.spec, 2, 32, graph.length, torch.bfloat16, rank=rank)
        assert check_graph(graph.hlo, sig, exp) == [], tag
        assert graph.hlo.count(" all-reduce(") == 2 * tiny0_ckpt.spec.num_layers
