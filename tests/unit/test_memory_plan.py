"""The memory plan (`info`): KV bytes per token of the layers with a linear cache, the rings' fixed
bytes, the longest context one inf2.8xlarge chip holds next to the weights, and --kv-len refused
(exit 2) with the numbers when it does not fit."""

from __future__ import annotations

import json

import pytest

from harness import FIXTURES_DIR
from harness.base.settings import DEFAULT_BUCKETS
from harness.cli import EXIT_BAD_INPUT, EXIT_OK, main
from harness.inputs.spec import load_spec
from harness.plan.memory import instance_memory_plan
from harness.port.core_fit import RUNTIME_RESERVE_BYTES, graph_reserve_bytes
from harness.port.sharding import bytes_per_rank, kv_cache_bytes

CONFIG_12B = FIXTURES_DIR / "configs" / "gemma-4-12b-it.json"
GiB = 2**30


@pytest.fixture(scope="module")
def spec12b():
    return load_spec(CONFIG_12B)


def test_12b_context_is_256k(spec12b):
    """Google's gemma-4-12B-it config gives max_position_embeddings 262144 (256K context)."""
    assert json.loads(CONFIG_12B.read_text())["text_config"]["max_position_embeddings"] == 262144
    assert spec12b.max_positions == 262144


def test_kv_bytes_from_the_layer_shapes(spec12b):
    """Per rank at TP=2 in bf16: sliding layers shard 8 KV heads of 256 (4 per rank), full layers
    replicate their one KV head of 512; a position is k and v. The ring keeps `window` positions of
    each sliding layer, whatever the context."""
    sliding = [layer for layer in spec12b.layers if layer.is_sliding]
    full = [layer for layer in spec12b.layers if not layer.is_sliding]
    row_sliding, row_full = 2 * 4 * 256 * 2, 2 * 1 * 512 * 2
    assert {(layer.kv_heads, layer.head_dim) for layer in sliding} == {(8, 256)}
    assert {(layer.kv_heads, layer.head_dim) for layer in full} == {(1, 512)}
    linear = kv_cache_bytes(spec12b, 2, "bfloat16", "linear")
    ring = kv_cache_bytes(spec12b, 2, "bfloat16", "ring")
    assert linear == {"per_token": len(sliding) * row_sliding + len(full) * row_full, "ring": 0}
    assert ring == {"per_token": len(full) * row_full, "ring": len(sliding) * row_sliding * spec12b.sliding_window}
    # the linear plan agrees with bytes_per_rank's KV cache at any length
    assert bytes_per_rank(spec12b, 2, "bfloat16", 1000)["kv_cache"] == 1000 * linear["per_token"]


def test_longest_context_on_one_inf2_chip(spec12b):
    """Both ranks of TP=2 share one 32 GiB chip: (32 GiB - weights - rings) / bytes per token,
    capped at the model's positions; the ring holds the whole 256K context, the linear cache
    about 29K."""
    plan = instance_memory_plan(spec12b, 2, "bfloat16", 4096)
    assert plan["device_bytes"] == 32 * GiB and plan["ranks_per_device"] == 2
    weights = 2 * bytes_per_rank(spec12b, 2, "bfloat16", 0)["weights"]
    assert plan["weights_bytes"] == weights
    for kind in ("linear", "ring"):
        cost = {k: 2 * v for k, v in kv_cache_bytes(spec12b, 2, "bfloat16", kind).items()}
        c = plan["caches"][kind]
        reserve = plan["graphs_reserve_bytes"]  # the compiled graphs' share (graph_bytes.graph_reserve_bytes)
        # the graphs' share and the runtime's reserve per rank (core_fit: the batch table counts the same)
        assert 0 < reserve == 2 * (graph_reserve_bytes(spec12b, 2, 2, DEFAULT_BUCKETS) + RUNTIME_RESERVE_BYTES)
        assert c["longest_by_memory"] == (32 * GiB - weights - reserve - cost["ring"]) // cost["per_token"]
        # the longest context fits, one more token does not
        assert weights + reserve + cost["ring"] + c["longest_by_memory"] * cost["per_token"] <= 32 * GiB
        assert weights + reserve + cost["ring"] + (c["longest_by_memory"] + 1) * cost["per_token"] > 32 * GiB
    assert 10_000 < plan["caches"]["linear"]["longest_context"] < 29163  # 29163 before the graphs were counted
    assert 131072 < plan["caches"]["ring"]["longest_context"] == plan["caches"]["ring"]["longest_by_memory"] < 262144


def test_info_prints_the_plan_and_refuses_a_kv_len_that_does_not_fit(spec12b, tmp_path, capsys):
    linear = instance_memory_plan(spec12b, 2)["caches"]["linear"]["longest_context"]
    out = tmp_path / "info.json"
    args = ["info", "--config", str(CONFIG_12B), "--tp", "2"]
    assert main(args + ["--kv-len", str(linear), "--json", str(out)]) == EXIT_OK
    text = capsys.readouterr().out
    assert f"= {linear} tokens" in text and "inf2.8xlarge" in text
    assert json.loads(out.read_text())["memory_plan"]["caches"]["linear"]["fits"]
    assert main(args + ["--kv-len", str(linear + 1)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"--kv-len {linear + 1} does not fit" in err and f"at most {linear} tokens" in err
    assert "--sliding-cache ring" in err
    assert main(args + ["--kv-len", "131072", "--sliding-cache", "ring"]) == EXIT_OK


def test_floors_at_length_follow_the_kv_buckets(spec12b):
    """A decode step reads its KV bucket: the ring's TPOT floor grows only with the 8 full layers'
    KV, the linear cache's with every layer's, so at the same context the ring's floor is lower; a
    long prompt's TTFT is the sum of its chunks' floors (each at its own bucket), so 8K costs more
    than 8 x 1K."""
    from harness.perf.context import call_costs, context_floors
    from harness.perf.roofline import floors, graph_costs, instance_rates

    rates = instance_rates("inf2.8xlarge", 2, "bf16")
    shape = {"buckets": (64, 256), "max_len": 262144, "rates": rates}
    ring = [context_floors(spec12b, 2, "bf16", n, **shape, sliding_cache="ring") for n in (1024, 8192)]
    linear = context_floors(spec12b, 2, "bf16", 8192, **shape, sliding_cache="linear")
    # KV buckets capped (device_plan.MAX_KV_BUCKETS): 64, 256, 1024, 4096, 16384, 65536, 262144
    assert ring[0]["decode_kv_bucket"] == 4096 and ring[1]["decode_kv_bucket"] == 16384
    assert ring[0]["tpot_ms"] < ring[1]["tpot_ms"] < linear["tpot_ms"]
    assert ring[1]["ttft_ms"] > 8 * ring[0]["ttft_ms"] * 0.99
    # the linear cache's costs are roofline.graph_costs' at the KV bucket
    assert call_costs(spec12b, 2, "bf16", 1, kv_read=16384, sliding_cache="linear") == graph_costs(
        spec12b, 2, "bf16", 1, 16384)
    assert linear["tpot_ms"] == floors(graph_costs(spec12b, 2, "bf16", 1, 16384), rates)["floor_ms"]
