"""The tiny fixture builder and the checkpoint reader: builds are deterministic from the seed and
go through transformers' own class, the weights are drawn so that the classic porting mistakes
show (layer_scalar and norm weights away from 1.0), per-layer reads return exactly one layer's
tensors, and the encoder-free multimodal layout is reported."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from harness.inputs.checkpoint import Checkpoint
from harness.inputs.shapes import expected_layer_shapes

from harness.base.errors import CheckpointError
from harness.inputs.spec import spec_from_config_dict
from harness.inputs.tiny import TINY_CONFIG, build_tiny_checkpoint

WEIGHTS = "model.safetensors"
FULL_LAYER, SLIDING_LAYER = 5, 4
TEXT_PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def built_seed0(tmp_path_factory):
    """A fresh seed-0 build by the current builder code (not the on-disk cache)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="module")
def built_ckpt(built_seed0):
    return Checkpoint.open(built_seed0)


def test_text_decoder_build_is_deterministic_from_the_seed(built_seed0, tmp_path):
    """Two builds with seed 0 write identical text-decoder tensors; seed 1 writes different ones."""
    first = load_file(built_seed0 / WEIGHTS)
    again = load_file(build_tiny_checkpoint(tmp_path / "again", seed=0) / WEIGHTS)
    other = load_file(build_tiny_checkpoint(tmp_path / "other", seed=1) / WEIGHTS)
    assert first.keys() == again.keys() == other.keys()
    text = [k for k in first if k.startswith(TEXT_PREFIX)]
    assert len(text) == len(Checkpoint.open(built_seed0).expected_shapes())
    assert all(torch.equal(first[k], again[k]) for k in text)
    differing = [k for k in text if not torch.equal(first[k], other[k])]
    assert f"{TEXT_PREFIX}embed_tokens.weight" in differing
    assert any(k.endswith("layer_scalar") for k in differing)


def test_whole_build_is_deterministic_from_the_seed(built_seed0, tmp_path):
    """Every stored tensor, inert multimodal ones included, is a function of the seed alone, so
    the checkpoint's file hashes recorded in goldens are reproducible."""
    torch.manual_seed(12345)  # a global RNG state unlike the fixture build's
    first = load_file(built_seed0 / WEIGHTS)
    again = load_file(build_tiny_checkpoint(tmp_path / "again", seed=0) / WEIGHTS)
    assert [k for k in first if not torch.equal(first[k], again[k])] == []


def test_builder_refuses_a_non_empty_directory(built_seed0):
    """A checkpoint is never overwritten silently."""
    with pytest.raises(CheckpointError, match="already exists"):
        build_tiny_checkpoint(built_seed0, seed=1)


def test_build_loads_with_transformers_class(built_seed0):
    """The build is a real Gemma4UnifiedForConditionalGeneration checkpoint: from_pretrained finds
    every key it expects, and its text decoder holds the file's tensors (full layers without v_proj)."""
    from transformers import Gemma4UnifiedForConditionalGeneration

    model, info = Gemma4UnifiedForConditionalGeneration.from_pretrained(built_seed0, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    stored = load_file(built_seed0 / WEIGHTS)
    for key in ("model.language_model.embed_tokens.weight", "model.language_model.layers.5.layer_scalar",
                "model.language_model.layers.3.self_attn.v_proj.weight"):
        assert torch.equal(state[key], stored[key])
    assert model.model.language_model.layers[FULL_LAYER].self_attn.v_proj is None


def test_layer_scalars_are_away_from_one(built_ckpt):
    """Every layer_scalar has |s - 1| >= 0.2, so a port that drops it fails visibly."""
    scalars = torch.cat([built_ckpt.layer_weights(i)["layer_scalar"] for i in range(built_ckpt.spec.num_layers)])
    assert scalars.shape == (built_ckpt.spec.num_layers,)
    assert bool(((scalars - 1).abs() >= 0.2).all()), scalars


def test_norm_weights_are_not_all_near_one(built_ckpt):
    """Each RMSNorm weight sits on average at least 0.1 from 1.0, so `1 + weight` (or ignoring the
    weight) changes the numbers."""
    norms = {"norm.weight": built_ckpt.final_norm_weight()}
    for i in range(built_ckpt.spec.num_layers):
        norms.update({f"layers.{i}.{name}": t for name, t in built_ckpt.layer_weights(i).items()
                      if name.endswith("norm.weight")})
    assert len(norms) == 1 + 6 * built_ckpt.spec.num_layers
    far = {name: float((w - 1).abs().mean()) for name, w in norms.items()}
    assert min(far.values()) >= 0.1, min(far.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("index", [SLIDING_LAYER, FULL_LAYER])
def test_layer_read_returns_exactly_that_layers_tensors(built_ckpt, built_seed0, index):
    """layer_weights(i) holds every stored tensor of layer i (and nothing else) with its stored
    values, names relative to the layer; the dtype argument converts."""
    stored = load_file(built_seed0 / WEIGHTS)
    prefix = f"model.language_model.layers.{index}."
    own = {k[len(prefix):]: t for k, t in stored.items() if k.startswith(prefix)}
    weights = built_ckpt.layer_weights(index)
    assert weights.keys() == own.keys()
    assert all(torch.equal(weights[name], own[name]) for name in own)
    shapes = expected_layer_shapes(built_ckpt.spec, built_ckpt.spec.layers[index])
    assert {name: tuple(t.shape) for name, t in weights.items()} == shapes
    assert ("self_attn.v_proj.weight" in weights) == (index == SLIDING_LAYER)
    assert {t.dtype for t in built_ckpt.layer_weights(index, torch.bfloat16).values()} == {torch.bfloat16}


def test_describe_reports_vision_and_audio_as_inert(built_ckpt):
    """The loader says the vision/audio configs are present but inert and no encoder weights exist."""
    text = built_ckpt.describe()
    assert "model.language_model." in text
    assert "vision_config" in text and "audio_config" in text
    assert "present but inert" in text
    assert "no vision or audio encoder" in text
    assert not any("tower" in key for key in built_ckpt.key_to_file)


def test_bare_text_config_is_accepted():
    """A gemma4_unified_text config (text_config alone) resolves to the same decoder layers as the
    unified config, with no multimodal parts or placeholder ids."""
    unified = json.loads(TINY_CONFIG.read_text())
    text = unified["text_config"]
    assert text["model_type"] == "gemma4_unified_text"
    bare = spec_from_config_dict(text, "text_config.json")
    full = spec_from_config_dict(unified, "config.json")
    assert bare.layers == full.layers
    assert (bare.hidden_size, bare.vocab_size, bare.final_logit_softcapping) == (
        full.hidden_size, full.vocab_size, full.final_logit_softcapping)
    assert bare.inert_parts == () and bare.placeholder_token_ids == ()
    assert bare.describe_inert() == "text-only config: no vision or audio parts"
