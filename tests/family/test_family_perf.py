"""Roofline floors of the family (info --perf): the MoE reads only the experts a token uses, shared
layers read and write no KV of their own, the per-layer table rows cross the host link."""

from __future__ import annotations

from harness import FIXTURES_DIR
from harness.inputs.spec import load_spec
from harness.perf.roofline import graph_costs, info_floors
from harness.port.sharding import bytes_per_rank

CONFIGS = FIXTURES_DIR / "configs"


def test_moe_decode_reads_top_k_experts_not_all():
    spec = load_spec(CONFIGS / "gemma-4-26b-a4b-it.json")
    tp, m, h = 4, spec.moe, spec.hidden_size
    all_weights = tp * bytes_per_rank(spec, tp)["weights"]
    per_expert = 3 * m.intermediate_size * h * 2  # bf16, gate + up + down, over all ranks
    decode = graph_costs(spec, tp, "bfloat16", 1, 256)
    assert abs(decode["weight_bytes"] - (all_weights - spec.num_layers * (m.num_experts - m.top_k) * per_expert)) < 1e3
    prefill = graph_costs(spec, tp, "bfloat16", 64, 256)
    assert decode["weight_bytes"] < prefill["weight_bytes"] < all_weights


def test_floors_on_the_instance_each_variant_needs():
    """31B at TP 8 is floored on the chips of an inf2.24xlarge; the 12B's published figure is not
    shown beside the family's floors."""
    big = info_floors(load_spec(CONFIGS / "gemma-4-31b-it.json"), 8, "bfloat16", instance="inf2.24xlarge")
    assert "4 chips" in big["rates"]["name"] and "published_ms" not in big
    e2b = load_spec(CONFIGS / "gemma-4-e2b-it.json")
    costs = graph_costs(e2b, 1, "bfloat16", 64, 256)
    assert costs["host_bytes"] == 64 * (e2b.hidden_size + 35 * 256) * 2 + e2b.vocab_size * 2
