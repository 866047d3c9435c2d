"""config.json -> ModelSpec: the released 12B resolves to the facts of docs/design.md#the-model-facts-and-traps
(read from the config, never from class defaults), the spec hash tracks the architecture and nothing else, and
the supported values of the feature keys the port checks are accepted."""

from __future__ import annotations

import json

import pytest

from harness import FIXTURES_DIR
from harness.base.errors import ConfigError
from harness.inputs.spec import FULL, SLIDING, load_spec, spec_from_config_dict

CONFIGS = FIXTURES_DIR / "configs"
CONFIG_12B = CONFIGS / "gemma-4-12b-it.json"
CONFIG_TINY = CONFIGS / "gemma-4-tiny.json"


@pytest.fixture(scope="module")
def spec_12b():
    return load_spec(CONFIG_12B)


def _tiny_config() -> dict:
    return json.loads(CONFIG_TINY.read_text())


def test_12b_has_five_sliding_then_one_full_eight_times(spec_12b):
    """48 layers; full attention at 5, 11, ..., 47 and sliding everywhere else."""
    assert spec_12b.num_layers == 48
    assert spec_12b.full_layers == [5, 11, 17, 23, 29, 35, 41, 47]
    assert [layer.index for layer in spec_12b.layers] == list(range(48))
    assert all(layer.type == (FULL if layer.index % 6 == 5 else SLIDING) for layer in spec_12b.layers)


def test_12b_sliding_layers(spec_12b):
    """Sliding layers: 16 q heads, 8 kv heads of head_dim 256, window 1024, default rope at 1e4
    rotating all 128 frequencies, separate v_proj."""
    for layer in spec_12b.layers:
        if layer.is_sliding:
            assert (layer.q_heads, layer.kv_heads, layer.head_dim) == (16, 8, 256)
            assert layer.window == 1024 and not layer.k_eq_v
            assert (layer.rope_type, layer.rope_theta, layer.rotated_freqs) == ("default", 1e4, 128)


def test_12b_full_layers(spec_12b):
    """Full layers: 16 q heads onto 1 kv head of head_dim 512 with k = v, no window, proportional
    rope at 1e6 rotating 0.25 * 512 / 2 = 64 frequencies."""
    for layer in spec_12b.layers:
        if not layer.is_sliding:
            assert (layer.q_heads, layer.kv_heads, layer.head_dim) == (16, 1, 512)
            assert layer.window is None and layer.k_eq_v
            assert (layer.rope_type, layer.partial_rotary_factor, layer.rope_theta) == ("proportional", 0.25, 1e6)
            assert layer.rotated_freqs == 64


def test_12b_model_level_facts(spec_12b):
    """Hidden 3840, MLP 15360, vocab 262144 tied to lm_head, softcap 30, eps 1e-6, gelu-tanh, and
    the three multimodal placeholder ids of the wrapper; vision/audio configs present but inert."""
    assert (spec_12b.hidden_size, spec_12b.intermediate_size, spec_12b.vocab_size) == (3840, 15360, 262144)
    assert spec_12b.final_logit_softcapping == 30.0
    assert spec_12b.rms_norm_eps == 1e-6
    assert spec_12b.hidden_activation == "gelu_pytorch_tanh"
    assert spec_12b.tie_word_embeddings
    assert spec_12b.sliding_window == 1024
    assert set(spec_12b.placeholder_token_ids) == {258880, 258884, 258881}
    assert spec_12b.inert_parts == ("vision_config", "audio_config")
    assert "present but inert" in spec_12b.describe_inert()


def test_spec_hash_ignores_where_the_config_came_from():
    """The same config read from two places has the same hash (golden files stay valid)."""
    config = _tiny_config()
    assert spec_from_config_dict(config, "a.json").spec_hash() == spec_from_config_dict(config, "b.json").spec_hash()


@pytest.mark.parametrize("key,value", [("sliding_window", 8), ("final_logit_softcapping", 20.0),
                                       ("rms_norm_eps", 1e-5), ("global_head_dim", 16)])
def test_spec_hash_changes_with_the_architecture(key, value):
    """Any change the numerics depend on changes the hash, so a golden of another model is refused."""
    config = _tiny_config()
    before = spec_from_config_dict(config).spec_hash()
    config["text_config"][key] = value
    assert spec_from_config_dict(config).spec_hash() != before


@pytest.mark.parametrize("bidirectional", [None, "vision"])
def test_supported_feature_values_are_accepted(bidirectional):
    """A text-only prompt under use_bidirectional_attention None or "vision" is plain causal, and
    num_kv_shared_layers 0 is no KV sharing: both resolve."""
    config = _tiny_config()
    config["text_config"]["use_bidirectional_attention"] = bidirectional
    config["text_config"]["num_kv_shared_layers"] = 0
    assert spec_from_config_dict(config).num_layers == 12


@pytest.mark.parametrize("key,value", [("attention_bias", True), ("hidden_activation", "silu")])
def test_other_unsupported_text_keys_are_named(key, value):
    """Projection biases and other activations are refused with the key in the message."""
    config = _tiny_config()
    config["text_config"][key] = value
    with pytest.raises(ConfigError, match=key):
        spec_from_config_dict(config, "cfg.json")


def test_unified_config_without_text_config_is_refused():
    """model_type gemma4_unified needs its text_config; the error says so."""
    config = _tiny_config()
    del config["text_config"]
    with pytest.raises(ConfigError, match="text_config"):
        spec_from_config_dict(config, "cfg.json")


def test_invalid_json_is_refused(tmp_path):
    """A config.json that is not JSON is a ConfigError naming the file."""
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_spec(path)
