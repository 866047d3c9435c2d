"""TP plans of the Gemma-4 family: the TP degrees each real config allows and the instance it needs
(per-core fit), experts split inside each expert, KV-shared layers without k/v or cache, and
properties over random valid family configs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import FIXTURES_DIR
from harness.base.errors import ShardingError
from harness.inputs.spec import load_spec, spec_from_config_dict
from harness.plan.instances import CORE_HBM, allowed_tps, check_fits
from harness.port.rank_merge import merge_layer_shards
from harness.port.sharding import bytes_per_rank, plan_model, shard_layer

CONFIGS = FIXTURES_DIR / "configs"


def _divides(spec, tp) -> bool:
    """The rule, written independently: query heads split; each layer's KV heads shard or replicate;
    every MLP width, the experts' width and the vocabulary split."""
    sizes = [spec.vocab_size] + [spec.mlp_size(layer) for layer in spec.layers]
    sizes += [spec.moe.intermediate_size] if spec.moe else []
    return (all(layer.q_heads % tp == 0 and (layer.kv_heads % tp == 0 or tp % layer.kv_heads == 0)
                for layer in spec.layers) and all(size % tp == 0 for size in sizes))


@pytest.mark.parametrize("name, expected", [("gemma-4-31b-it", [1, 2, 4, 8, 16]), ("gemma-4-e2b-it", [1, 2, 4, 8]),
                                            ("gemma-4-e4b-it", [1, 2, 4, 8]), ("gemma-4-26b-a4b-it", [1, 2, 4, 8, 16])])
def test_allowed_tp_degrees_of_the_real_configs(name, expected):
    spec = load_spec(CONFIGS / f"{name}.json")
    assert allowed_tps(spec) == expected == [tp for tp in range(1, 25) if _divides(spec, tp)]


@pytest.mark.parametrize("name, tp, instance", [("gemma-4-31b-it", 8, "inf2.24xlarge"), ("gemma-4-e2b-it", 1, "inf2.8xlarge"),
                                                ("gemma-4-e4b-it", 2, "inf2.8xlarge"),
                                                ("gemma-4-26b-a4b-it", 4, "inf2.24xlarge")])
def test_each_variant_fits_its_instance(name, tp, instance):
    spec = load_spec(CONFIGS / f"{name}.json")
    where = check_fits(spec, tp)
    assert where["instance"] == instance and where["bytes_per_rank"] <= CORE_HBM


@pytest.mark.parametrize("name, tp", [("gemma-4-31b-it", 2), ("gemma-4-26b-a4b-it", 2), ("gemma-4-31b-it", 32)])
def test_a_tp_that_does_not_fit_is_refused_with_the_numbers(name, tp):
    with pytest.raises(ShardingError, match=r"GiB|NeuronCores"):
        check_fits(load_spec(CONFIGS / f"{name}.json"), tp)


def test_31b_at_tp8_replicates_the_four_global_kv_heads():
    spec = load_spec(CONFIGS / "gemma-4-31b-it.json")
    plans = plan_model(spec, 8)
    full = [p for p, layer in zip(plans, spec.layers) if not layer.is_sliding]
    assert full and all((p.kv_heads, p.kv_layout, p.kv_heads_per_rank) == (4, "replicate", 1) for p in full)
    assert [full[0].kv_heads_for_rank(r)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@st.composite
def family_configs(draw):
    """A valid gemma4 text config (tiny widths) and a TP degree its plan allows."""
    tp = draw(st.sampled_from([1, 2, 4]))
    kv = tp * draw(st.integers(1, 2))
    q = kv * draw(st.integers(1, 2))
    layers = draw(st.integers(4, 8))
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    types[draw(st.integers(0, layers - 2))] = "full_attention"
    shared = draw(st.integers(0, 2)) if types[:layers - 2].count("full_attention") else 0
    moe = draw(st.booleans())
    config = {"model_type": "gemma4_text", "hidden_size": 16, "intermediate_size": 8 * tp, "num_hidden_layers": layers,
              "num_attention_heads": q, "num_key_value_heads": kv, "num_global_key_value_heads": None,
              "head_dim": 4, "global_head_dim": 8, "vocab_size": 32 * tp, "layer_types": types, "sliding_window": 4,
              "attention_k_eq_v": False, "num_kv_shared_layers": shared, "use_double_wide_mlp": True,
              "hidden_size_per_layer_input": draw(st.sampled_from([0, 4])), "vocab_size_per_layer_input": 32 * tp,
              "enable_moe_block": moe}
    if moe:
        config.update(num_experts=draw(st.integers(2, 6)), top_k_experts=2, moe_intermediate_size=4 * tp)
    return spec_from_config_dict(config, "<hypothesis>"), tp


@settings(max_examples=25, deadline=None)
@given(family_configs(), st.integers(0, 2 ** 16))
def test_family_shards_merge_back(drawn, seed):
    """Every layer's tensors (experts, per-layer gate, shared layers without k/v) split over the
    ranks and concatenate back exactly; each rank holds a 1/tp slice of every expert; the per-rank
    bytes shrink with tp by no more than the split share."""
    from harness.inputs.shapes import expected_layer_shapes

    spec, tp = drawn
    gen = torch.Generator().manual_seed(seed)
    for layer, plan in zip(spec.layers, plan_model(spec, tp)):
        shapes = expected_layer_shapes(spec, layer)
        assert ("self_attn.k_proj.weight" in shapes) == (layer.kv_source is None)
        weights = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
        shards = [shard_layer(weights, plan, r) for r in range(tp)]
        merged = merge_layer_shards(shards, plan)
        assert all(torch.equal(merged[n], w) for n, w in weights.items())
        if spec.moe is not None:
            mi = spec.moe.intermediate_size // tp
            assert all(s["experts.down_proj"].shape == (spec.moe.num_experts, spec.hidden_size, mi) for s in shards)
    one, many = bytes_per_rank(spec, 1)["weights"], bytes_per_rank(spec, tp)["weights"]
    assert one / tp <= many <= one
