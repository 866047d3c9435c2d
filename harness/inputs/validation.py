"""Validation of a Gemma-4 text config as the file gives it, before transformers fills in class
defaults: dimensions present, positive and dividing, per-layer overrides, token ids, rope
parameters, and the features the port does not implement refused by key."""

from __future__ import annotations

import math

from harness.base.errors import ConfigError
from harness.inputs.family import refuse_family_features, validate_family_keys

SLIDING = "sliding_attention"
FULL = "full_attention"


def unsupported(source: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(
        f"{source}: unsupported config key {key}={value!r}: {why}. The port covers the Gemma-4 text "
        "decoders (the 12B as gemma4_unified; 31B, E2B/E4B and 26B-A4B as gemma4); use a checkpoint "
        "without this feature."
    )


# Read from the config as given, before transformers fills in class defaults (which describe a
# different, smaller model): each must be present and a positive integer.
REQUIRED_DIMENSIONS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size")
MAX_DIMENSION = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
                 "num_global_key_value_heads": 4096}
OPTIONAL_DIMENSIONS = ("global_head_dim", "num_global_key_value_heads", "sliding_window",
                       "max_position_embeddings")


def bad_value(source: str, key: str, value, want: str) -> ConfigError:
    return ConfigError(f"{source}: config key {key}={value!r} {want}. Fix config.json (use the one the "
                       "weights were saved with).")


def _positive_int(text: dict, key: str, source: str, required: bool) -> int | None:
    if text.get(key) is None:
        if required:
            raise bad_value(source, key, None, "is missing; the transformers default describes another "
                             "model, so it must be given")
        return None
    value = text[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_value(source, key, value, "must be a positive integer")
    if value > MAX_DIMENSION.get(key, 2 ** 31 - 1):
        raise bad_value(source, key, value, f"is implausibly large (at most {MAX_DIMENSION.get(key, 2 ** 31 - 1)})")
    return value


def _positive_number(text: dict, key: str, source: str, allow_none: bool = True) -> None:
    value = text.get(key)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise bad_value(source, key, value, "must be a finite positive number")


def _validate_dimensions(text: dict, source: str) -> None:
    """Sizes, head counts and windows as the config gives them: positive integers that divide."""
    dims = {k: _positive_int(text, k, source, True) for k in REQUIRED_DIMENSIONS}
    dims.update({k: _positive_int(text, k, source, False) for k in OPTIONAL_DIMENSIONS})
    layer_types = text.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != dims["num_hidden_layers"]:
            raise bad_value(source, "layer_types", layer_types, f"must be a list of num_hidden_layers="
                             f"{dims['num_hidden_layers']} entries")
        if SLIDING in layer_types and dims["sliding_window"] is None:
            raise bad_value(source, "sliding_window", None, "is missing but layer_types has sliding layers")
    heads = dims["num_attention_heads"]
    for kv_key in ("num_key_value_heads", "num_global_key_value_heads"):
        if dims[kv_key] is not None and heads % dims[kv_key]:
            raise bad_value(source, kv_key, dims[kv_key], f"must divide num_attention_heads={heads}")
    for dim_key in ("head_dim", "global_head_dim"):
        if dims[dim_key] is not None and dims[dim_key] % 2:
            raise bad_value(source, dim_key, dims[dim_key], "must be even (rotary embeddings pair lanes)")
    _validate_per_layer(text.get("per_layer_config"), dims, source)
    _positive_number(text, "rms_norm_eps", source)
    _positive_number(text, "final_logit_softcapping", source)
    for id_key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = text.get(id_key)
        for t in (ids if isinstance(ids, list) and id_key == "eos_token_id" else [ids]):
            if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < dims["vocab_size"]):
                raise bad_value(source, id_key, ids, f"must be a token id in [0, vocab_size={dims['vocab_size']})")
    rope = text.get("rope_parameters")
    if isinstance(rope, dict):
        for kind, params in rope.items():
            if isinstance(params, dict):
                _positive_number(params, "rope_theta", f"{source}: rope_parameters.{kind}", allow_none=False)
                factor = params.get("partial_rotary_factor")
                if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                           or not 0 < factor <= 1):
                    raise bad_value(source, f"rope_parameters.{kind}.partial_rotary_factor", factor,
                                     "must be in (0, 1]")


# What a layer may override (transformers' per_layer_config, as save_pretrained writes it: layer
# index -> attributes); the port reads exactly these per layer, so any other override would be
# honoured by the reference and not by the port.
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


def _validate_per_layer(overrides, dims: dict, source: str) -> None:
    """per_layer_config validated like the top level: layer indices in range and given once, each
    override a positive integer, KV heads dividing the query heads, head dims even."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise bad_value(source, "per_layer_config", overrides, "must be an object of layer index -> overrides")
    layers, seen = dims["num_hidden_layers"], {}
    for key, values in overrides.items():
        where = f"{source}: per_layer_config[{key!r}]"
        index = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if index is None or index >= layers or index in seen:
            why = f"is given twice (also as {seen[index]!r})" if index in seen else f"is not a layer index in [0, {layers})"
            raise ConfigError(f"{where}: the key {why}. Fix config.json (use the one the weights were saved with).")
        seen[index] = key
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: must be an object of overrides, got {values!r}. Fix config.json.")
        unknown = sorted(set(values) - set(PER_LAYER_KEYS))
        if unknown:
            raise unsupported(where, unknown[0], values[unknown[0]], f"the port overrides only "
                               f"{' and '.join(PER_LAYER_KEYS)} per layer")
        layer = {k: _positive_int(values, k, where, False) for k in PER_LAYER_KEYS}
        if layer["num_key_value_heads"] and dims["num_attention_heads"] % layer["num_key_value_heads"]:
            raise bad_value(where, "num_key_value_heads", layer["num_key_value_heads"],
                             f"must divide num_attention_heads={dims['num_attention_heads']}")
        if layer["head_dim"] and layer["head_dim"] % 2:
            raise bad_value(where, "head_dim", layer["head_dim"], "must be even (rotary embeddings pair lanes)")


def refuse_heterogeneous_types(layers, source: str) -> None:
    """Resolved layers (after per_layer_config): every layer of one type must share its head width
    and KV heads (transformers refuses the model otherwise, inside its model class: "Layer type ...
    is not homogeneous"); refused here, before any weight is read or transformers loads a model."""
    first: dict = {}
    for layer in layers:
        ref = first.setdefault(layer.type, layer)
        for key, a, b in (("head_dim", ref.head_dim, layer.head_dim), ("num_key_value_heads", ref.kv_heads,
                                                                        layer.kv_heads)):
            if a != b:
                raise ConfigError(f"{source}: per_layer_config gives {layer.type} layers different {key} (layer "
                                  f"{ref.index}: {a}, layer {layer.index}: {b}); every layer of a type must share "
                                  "it (transformers refuses the model otherwise). Fix config.json (use the one the "
                                  "weights were saved with).")


def validate_text_config(text: dict, source: str, family: bool = False) -> None:
    _validate_dimensions(text, source)
    if text.get("use_bidirectional_attention") == "all":
        raise unsupported(source, "use_bidirectional_attention", "all",
                           "the port is a causal decoder; only None or \"vision\" are supported")
    (validate_family_keys if family else refuse_family_features)(text, source)
    if text.get("attention_bias"):
        raise unsupported(source, "attention_bias", True, "the port's projections have no bias")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise unsupported(source, "hidden_activation", act, "only gelu_pytorch_tanh is implemented")
