"""Sharded attention equals unsharded attention: one layer of harness.port.model.Attention run at tp=1
and as tp ranks whose o_proj partial outputs are summed in fp32 (what the all-reduce does)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from harness.inputs.spec import LayerSpec, load_spec
from harness.inputs.tiny import TINY_CONFIG
from harness.port.model import Attention, RankLinears, attention_mask, rope_cos_sin, rope_inv_freq
from harness.port.sharding import plan_layer, shard_layer
from tests.strategies import head_layouts

# fp32 results that differ only in how o_proj's inner sum is split across ranks: a few fp32 ulps
# of the output's scale (inner sums here are at most 64 heads x 8 lanes long).
FP32_SUM_ORDER = 1e-5


@pytest.fixture(scope="module")
def tiny_spec():
    return load_spec(TINY_CONFIG)


def _layer(q_heads, kv_heads, head_dim, k_eq_v, window) -> LayerSpec:
    """A sliding layer (default rope) when `window` is set, else a full layer (proportional rope)."""
    full = window is None
    return LayerSpec(index=0, type="full_attention" if full else "sliding_attention", head_dim=head_dim,
                     q_heads=q_heads, kv_heads=kv_heads, k_eq_v=k_eq_v, window=window,
                     rope_type="proportional" if full else "default", rope_theta=1e6 if full else 1e4,
                     partial_rotary_factor=0.25 if full else 1.0)


def _attention_weights(layer: LayerSpec, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of one attention layer, named as in the checkpoint (relative to the layer).
    Norm weights are random too, so a head paired with the wrong norm lanes shows."""
    gen = torch.Generator().manual_seed(seed)
    d, q, kv = layer.head_dim, layer.q_heads, layer.kv_heads
    weights = {
        "self_attn.q_proj.weight": torch.randn(q * d, hidden, generator=gen),
        "self_attn.k_proj.weight": torch.randn(kv * d, hidden, generator=gen),
        "self_attn.o_proj.weight": torch.randn(hidden, q * d, generator=gen) / (q * d) ** 0.5,
        "self_attn.q_norm.weight": 1 + torch.rand(d, generator=gen),
        "self_attn.k_norm.weight": 1 + torch.rand(d, generator=gen),
    }
    if not layer.k_eq_v:
        weights["self_attn.v_proj.weight"] = torch.randn(kv * d, hidden, generator=gen)
    return weights


def _run_rank(spec, layer, plan, weights, x, max_len) -> torch.Tensor:
    """One rank's attention output: with the default (no-op) collectives, o_proj's partial product."""
    attn = Attention(spec, layer, plan, RankLinears(), max_len, torch.float32)
    attn.load_state_dict({k.removeprefix("self_attn."): v for k, v in weights.items()}, strict=True)
    positions = torch.arange(x.shape[1])[None]
    cos, sin = rope_cos_sin(rope_inv_freq(layer), positions, torch.float32)
    mask = attention_mask(positions, max_len, layer.window, torch.float32)
    with torch.no_grad():
        return attn(x, cos, sin, positions, mask)


def _sharded(spec, layer, weights, x, tp, max_len) -> torch.Tensor:
    """tp ranks on their shards, partial outputs summed in fp32 in rank order (the all-reduce)."""
    plan = plan_layer(layer, tp)
    total = torch.zeros(x.shape, dtype=torch.float32)
    for rank in range(tp):
        total = total + _run_rank(spec, layer, plan, shard_layer(weights, plan, rank), x, max_len).float()
    return total


def _assert_fp32_equal(sharded, unsharded, what):
    scale = unsharded.abs().max().item()
    err = (sharded - unsharded).abs().max().item()
    assert err <= FP32_SUM_ORDER * max(scale, 1e-30), f"{what}: max |diff| {err:.3e} at scale {scale:.3e}"


@given(layout=head_layouts(), k_eq_v=st.booleans(), window=st.none() | st.integers(1, 6),
       seq=st.integers(1, 8), hidden=st.sampled_from([8, 16]), seed=st.integers(0, 2**16))
@example(layout=(16, 1, 2, 8), k_eq_v=True, window=None, seq=6, hidden=16, seed=0).via("12B full")
@example(layout=(16, 8, 2, 4), k_eq_v=False, window=3, seq=8, hidden=16, seed=0).via("12B sliding")
@example(layout=(32, 4, 8, 8), k_eq_v=True, window=None, seq=5, hidden=8, seed=0).via("31B full")
@example(layout=(32, 16, 8, 4), k_eq_v=False, window=2, seq=5, hidden=8, seed=0).via("31B sliding")
def test_sharded_attention_equals_unsharded(tiny_spec, layout, k_eq_v, window, seq, hidden, seed):
    """For any shardable head layout, sliding or full, with or without k=v, the sum of the ranks'
    o_proj partial outputs equals single-rank attention to fp32 summation-order rounding."""
    q_heads, kv_heads, tp, head_dim = layout
    layer = _layer(q_heads, kv_heads, head_dim, k_eq_v, window)
    spec = replace(tiny_spec, hidden_size=hidden, layers=(layer,))
    weights = _attention_weights(layer, hidden, seed)
    x = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(seed + 1))
    max_len = seq + 2  # unwritten cache slots past the sequence must stay masked
    unsharded = _run_rank(spec, layer, plan_layer(layer, 1), weights, x, max_len)
    _assert_fp32_equal(_sharded(spec, layer, weights, x, tp, max_len), unsharded, f"layout {layout}")


def test_tiny_checkpoint_attention_sharded_equals_unsharded(tiny0_ckpt):
    """Every attention layer of the tiny checkpoint (sliding, 8 KV heads; full, 1 KV head with k=v)
    gives the same output split over the port's 2 ranks as on one rank, past the window of 16 keys
    (other TP degrees are drawn by the property test above)."""
    tp = 2
    spec = tiny0_ckpt.spec
    x = torch.randn(1, 20, spec.hidden_size, generator=torch.Generator().manual_seed(7))
    for layer in spec.layers:
        weights = {k: v for k, v in tiny0_ckpt.layer_weights(layer.index, torch.float32).items()
                   if k.startswith("self_attn.")}
        unsharded = _run_rank(spec, layer, plan_layer(layer, 1), weights, x, 24)
        _assert_fp32_equal(_sharded(spec, layer, weights, x, tp, 24), unsharded, f"layer {layer.index}")


def test_wrong_kv_head_on_a_rank_is_detected(tiny_spec, monkeypatch):
    """The comparison can fail: if replicated ranks all read KV head 0 (a plausible sharding bug
    for the 31B's full layers), sharded attention no longer equals unsharded."""
    import harness.port.sharding as sharding

    monkeypatch.setattr(sharding, "kv_heads_for_rank", lambda plan, rank: [0] * plan.kv_heads_per_rank)
    layer = _layer(32, 4, 8, True, None)
    spec = replace(tiny_spec, hidden_size=8, layers=(layer,))
    weights = _attention_weights(layer, 8, seed=3)
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(4))
    unsharded = _run_rank(spec, layer, plan_layer(layer, 1), weights, x, 5)
    with pytest.raises(AssertionError):
        _assert_fp32_equal(_sharded(spec, layer, weights, x, 8, 5), unsharded, "31B full, KV head 0 on all")
