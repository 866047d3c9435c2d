"""The per-graph statistics: scaling one-layer pieces by layer counts gives exactly the FLOPs,
bytes and collectives that lowering the whole model gives (checked on the tiny model, where the
whole graph is cheap to lower), and op counts within 10% above it."""

from __future__ import annotations

import pytest
import torch

from harness.base.settings import RunSettings
from harness.hlo.contracts import graph_stats
from harness.hlo.stats import model_graph_stats
from harness.report.formats import format_graph_stats
from tests.xla.conftest import KV_LEN, lower_tiny

pytestmark = pytest.mark.xla


@pytest.mark.parametrize("tp", [1, 2])
def test_scaled_pieces_equal_the_whole_graph(tiny_spec, tp):
    result = model_graph_stats(tiny_spec, RunSettings(tp=tp, kv_len=KV_LEN, buckets=(16,)))
    assert result["layers"] == {"sliding_attention": 10, "full_attention": 2}
    for tag, length in (("prefill_16", 16), ("decode", 1)):
        graph, sig, _ = lower_tiny(tiny_spec, tp, length)
        whole = graph_stats(graph.hlo, sig)
        total = result["graphs"][tag]["total"]
        assert result["graphs"][tag]["contract_violations"] == {}
        for key in ("dot_flops", "weight_bytes", "state_bytes", "returned_bytes", "collectives"):
            assert total[key] == getattr(whole, key), (tag, key)
        # Op counts only bound the whole graph's: it builds each window's mask once and shares
        # literals between layers, which every scaled piece counts again (METHOD["ops"]).
        assert sum(whole.ops.values()) <= total["ops_total"] <= 1.1 * sum(whole.ops.values())
    table = format_graph_stats(result)
    assert "| prefill_16 | 16 |" in table and "| decode | 1 |" in table


def test_12b_decode_reads_its_weights_once_and_returns_one_row_of_logits():
    """The 12B's real config at TP=2, decode graph only: weights per rank near docs/design.md#performance-facts's ~12 GB,
    2 FLOPs per weight per token, one bf16 vocab row back to the host, two all-reduces per layer."""
    from harness.inputs.spec import load_spec

    spec = load_spec("fixtures/configs/gemma-4-12b-it.json")
    result = model_graph_stats(spec, RunSettings(tp=2, kv_len=256, buckets=(1,)))
    total = result["graphs"]["decode"]["total"]
    assert result["graphs"]["decode"]["contract_violations"] == {}
    assert 11.5e9 < total["weight_bytes"] < 12.5e9
    assert total["dot_flops"] == pytest.approx(total["weight_bytes"], rel=0.02)  # 2 FLOPs per 2-byte weight
    assert total["returned_bytes"] == spec.vocab_size * 2
    assert total["collectives"] == {"all-reduce": 2 * spec.num_layers, "all-gather": 1}
    assert torch.bfloat16.itemsize == 2


@pytest.mark.parametrize("tp", [1, 2])
def test_roofline_costs_equal_the_lowered_graphs(tiny_spec, tp):
    """perf's roofline (derived from the spec and the TP plan) and the XLA lane's lowered graphs
    (every HLO dot, summed over ranks) agree on each graph's matmul FLOPs and bytes returned: the
    floors `bench` reports are the graphs that run."""
    from harness.perf import roofline

    result = model_graph_stats(tiny_spec, RunSettings(tp=tp, kv_len=KV_LEN, buckets=(16,)))
    for tag, tokens in (("prefill_16", 16), ("decode", 1)):
        costs = roofline.graph_costs(tiny_spec, tp, "bf16", tokens, KV_LEN)
        total = result["graphs"][tag]["total"]
        assert tp * total["dot_flops"] == costs["flops"], tag
        returned = costs["host_bytes"] - tokens * tiny_spec.hidden_size * 2  # minus the embeddings sent in
        assert total["returned_bytes"] == returned, tag
