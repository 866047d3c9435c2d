"""Unit checks of the per-rank decoder's building blocks against transformers' own, bit for bit
where the computation is the same (faults too small for the bf16 envelope show here)."""

from __future__ import annotations

import torch
from transformers.models.gemma4_unified import modeling_gemma4_unified as hf

from harness.port import model as port


def rms_norm_matches_transformers(dtype=torch.bfloat16, with_weight: bool = True) -> bool:
    """The port's rms_norm equals transformers' Gemma4UnifiedRMSNorm bit for bit on `dtype` input:
    same fp32 upcast, same pow(-0.5), weight used as stored, cast back."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 7, 96, generator=gen) * 30).to(dtype)
    ref = hf.Gemma4UnifiedRMSNorm(96, eps=1e-6, with_scale=with_weight)
    weight = None
    if with_weight:
        with torch.no_grad():
            ref.weight.copy_(0.5 + torch.rand(96, generator=gen))
        weight = ref.weight.detach().to(dtype)
        ref = ref.to(dtype)
    with torch.no_grad():
        return torch.equal(port.rms_norm(x, weight, 1e-6), ref(x))


def test_rms_norm_is_bitwise_transformers_in_bf16_and_fp32():
    """RMSNorm computes in fp32 and casts back (docs/design.md#the-model-facts-and-traps, trap 1); a bf16-only
    norm differs by a few roundings, within the envelope, so it is pinned here instead."""
    for dtype in (torch.bfloat16, torch.float32):
        assert rms_norm_matches_transformers(dtype, with_weight=True)
        assert rms_norm_matches_transformers(dtype, with_weight=False)


def test_rope_tables_equal_transformers():
    """inv_freq of both layer types equals transformers' rotary embedding's (proportional rope
    divides by the full head_dim and zeroes the rest)."""
    from harness.inputs.tiny import TINY_CONFIG
    import json

    from transformers import Gemma4UnifiedConfig
    from harness.inputs.spec import spec_from_config_dict

    config = json.loads(TINY_CONFIG.read_text())
    spec = spec_from_config_dict(config)
    text = Gemma4UnifiedConfig(**{k: v for k, v in config.items() if k != "architectures"}).text_config
    rotary = hf.Gemma4UnifiedTextRotaryEmbedding(text)
    for layer in (spec.layers[0], spec.layers[spec.full_layers[0]]):
        assert torch.equal(port.rope_inv_freq(layer), getattr(rotary, f"{layer.type}_inv_freq"))
