"""What the gemma4 model type adds over the unified 12B's decoder, read from its config:
per-layer input embeddings (E2B/E4B) and the mixture-of-experts block (26B-A4B); and KV sharing
with the double-wide MLP on shared layers, which both model types' configurations and modelings
have (E2B/E4B use it; a unified config may). The rules are transformers' modeling_gemma4 /
configuration_gemma4 (Gemma4TextConfig.kv_sharing_modes, Gemma4TextMLP, Gemma4TextRouter) and
configuration_gemma4_unified's kv_sharing_modes, the same rule."""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.base.errors import ConfigError

@dataclass(frozen=True)
class MoESpec:
    """The 26B-A4B's mixture-of-experts block, beside the dense MLP of every layer."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert


PLE_KEYS = ("hidden_size_per_layer_input", "vocab_size_per_layer_input")
MOE_KEYS = ("num_experts", "top_k_experts", "moe_intermediate_size")


def _problem(source: str, key: str, value, want: str) -> ConfigError:
    return ConfigError(f"{source}: config key {key}={value!r} {want}. Fix config.json (use the one the "
                       "weights were saved with).")


def _unsupported(source: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(f"{source}: unsupported config key {key}={value!r}: {why}. The port covers the "
                       "Gemma-4 text decoders (the 12B as gemma4_unified; 31B, E2B/E4B and 26B-A4B as "
                       "gemma4); use a checkpoint without this feature.")


def _int_at_least(text: dict, key: str, source: str, low: int) -> int:
    value = text.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _problem(source, key, value, f"must be an integer >= {low}")
    return value


def refuse_family_features(text: dict, source: str) -> None:
    """The unified 12B's module has none of the family's per-layer inputs and experts (its KV
    sharing, num_kv_shared_layers and use_double_wide_mlp, it has: validate_kv_sharing)."""
    validate_kv_sharing(text, source)
    for key in PLE_KEYS:
        if text.get(key):
            raise _unsupported(source, key, text[key], "per-layer embeddings are a gemma4 (E2B/E4B) "
                               "feature; gemma4_unified has none")
    for key in ("enable_moe_block", "num_local_experts") + MOE_KEYS:
        if text.get(key):
            raise _unsupported(source, key, text[key], "mixture-of-experts layers are a gemma4 (26B-A4B) "
                               "feature; gemma4_unified has none")


def validate_kv_sharing(text: dict, source: str) -> None:
    """num_kv_shared_layers (both model types' configurations and modelings have it): an integer
    below the layer count, so some layer computes the keys and values the shared layers read."""
    layers = text["num_hidden_layers"]
    shared = text.get("num_kv_shared_layers") or 0
    if shared and _int_at_least(text, "num_kv_shared_layers", source, 0) >= layers:
        raise _problem(source, "num_kv_shared_layers", shared, f"must be below num_hidden_layers={layers} "
                       "(some layer must compute the keys and values the shared layers read)")


def validate_family_keys(text: dict, source: str) -> None:
    """The family's own keys, as given: integers in range, each feature complete."""
    validate_kv_sharing(text, source)
    if text.get("hidden_size_per_layer_input"):
        _int_at_least(text, "hidden_size_per_layer_input", source, 1)
        ple_vocab = text.get("vocab_size_per_layer_input", 262_144)
        if isinstance(ple_vocab, bool) or not isinstance(ple_vocab, int) or ple_vocab < text["vocab_size"]:
            raise _problem(source, "vocab_size_per_layer_input", ple_vocab, f"must be an integer >= "
                           f"vocab_size={text['vocab_size']} (every token id indexes the per-layer table)")
    if text.get("num_local_experts"):
        raise _unsupported(source, "num_local_experts", text["num_local_experts"], "gemma4 names it num_experts")
    if text.get("enable_moe_block"):
        for key in MOE_KEYS:
            _int_at_least(text, key, source, 1)
        if text["top_k_experts"] > text["num_experts"]:
            raise _problem(source, "top_k_experts", text["top_k_experts"],
                           f"must be at most num_experts={text['num_experts']}")
    else:
        for key in MOE_KEYS:
            if text.get(key):
                raise _problem(source, key, text[key], "is set but enable_moe_block is not: the experts "
                               "would be ignored; set enable_moe_block or drop the key")


def kv_store_layers(tc, source: str) -> dict[str, int]:
    """Per attention type, the layer transformers marks "store" (kv_sharing_modes, 5.24): the last
    unshared layer of that type, whose keys and values the shared layers and an assistant read.
    Marked on every model, with KV sharing or without."""
    layer_types = list(tc.layer_types)
    try:
        modes = list(tc.kv_sharing_modes)
    except ValueError as exc:  # transformers' own refusal (a type with no producing layer)
        raise _problem(source, "num_kv_shared_layers", tc.num_kv_shared_layers, f"is refused by transformers: {exc}") from None
    stores = {layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    if set(stores) != set(layer_types):
        missing = sorted(set(layer_types) - set(stores))
        raise _problem(source, "num_kv_shared_layers", tc.num_kv_shared_layers, f"leaves no unshared {missing[0]} "
                       "layer to store the keys and values that layer type's readers need")
    return stores


def kv_sources(tc, source: str) -> list[int | None]:
    """For each layer, the layer whose cache it reads (None: its own): a layer transformers marks
    "reuse" reads the "store" layer of its own attention type (kv_sharing_modes)."""
    stores = kv_store_layers(tc, source)
    return [stores[t] if mode == "reuse" else None for t, mode in zip(tc.layer_types, tc.kv_sharing_modes)]


def kv_sharing_layers(tc, layers: list, source: str) -> list:
    """Layers with their KV source and MLP width (the double-wide MLP is on shared layers only):
    the same rule in both model types' modelings."""
    sources = kv_sources(tc, source)
    wide = 2 * int(tc.intermediate_size) if tc.use_double_wide_mlp else None
    return [replace(layer, kv_source=src, intermediate_size=wide if src is not None else None)
            for layer, src in zip(layers, sources)]


def family_fields(tc, source: str) -> dict:
    """The ModelSpec fields of PLE and MoE (gemma4 only)."""
    extra: dict = {}
    if tc.hidden_size_per_layer_input:
        extra["per_layer_input_size"] = int(tc.hidden_size_per_layer_input)
        extra["per_layer_vocab_size"] = int(tc.vocab_size_per_layer_input)
    if tc.enable_moe_block:
        extra["moe"] = MoESpec(num_experts=int(tc.num_experts), top_k=int(tc.top_k_experts),
                               intermediate_size=int(tc.moe_intermediate_size))
    return extra


def runs_alone(spec, index: int) -> bool:
    """Whether one layer can be run alone on a captured input: not with a per-layer input (it
    depends on the token ids) nor a KV-shared layer (it reads another layer's cache)."""
    return not spec.per_layer_input_size and spec.layers[index].kv_source is None
