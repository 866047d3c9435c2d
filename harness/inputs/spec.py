"""config.json -> resolved per-layer spec of the Gemma-4 text decoder; validation; memory estimate."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.base.errors import ConfigError, not_a_file, read_json_file
from harness.inputs.family import MoESpec, family_fields, kv_sharing_layers, kv_store_layers
from harness.inputs.validation import (FULL, SLIDING, bad_value, refuse_heterogeneous_types, unsupported,
                                       validate_text_config)

SUPPORTED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text", "gemma4", "gemma4_text")
# Model types whose text decoder is transformers' modeling_gemma4 (31B, E2B/E4B, 26B-A4B); the
# others are the unified 12B's modeling_gemma4_unified.
FAMILY_MODEL_TYPES = ("gemma4", "gemma4_text")
DRAFTER_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
# transformers' own (config class, model class) per model type: what a published checkpoint is saved
# with (the conditional-generation classes carry the vision/audio parts) and what the reference, the
# loader's shape check of the inert parts and the tiny builder instantiate.
TRANSFORMERS_CLASSES = {"gemma4_unified": ("Gemma4UnifiedConfig", "Gemma4UnifiedForConditionalGeneration"),
                        "gemma4_unified_text": ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM"),
                        "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
                        "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM")}
# The multimodal wrapper swaps these placeholder ids for the pad id before embedding
# (docs/design.md#the-model-facts-and-traps, trap 7).
DEFAULT_PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "audio_token_id")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the port runs it."""

    index: int
    type: str  # "sliding_attention" | "full_attention"
    head_dim: int
    q_heads: int
    kv_heads: int
    k_eq_v: bool  # full layers of the 12B: no v_proj, value = raw k_proj output
    window: int | None  # keys seen including itself; None on full layers
    rope_type: str  # "default" | "proportional"
    rope_theta: float
    partial_rotary_factor: float
    # KV sharing (E2B/E4B): the layer whose cache this layer reads; it has no k/v projections and
    # writes no cache. None: the layer computes and caches its own keys and values.
    kv_source: int | None = None
    # The MLP width when it differs from the model's (E2B's double-wide MLP on shared layers).
    intermediate_size: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.type == SLIDING

    @property
    def rotated_freqs(self) -> int:
        """How many of the head_dim/2 rope frequencies rotate (the rest are zero)."""
        if self.rope_type == "proportional":
            return int(self.partial_rotary_factor * self.head_dim // 2)
        return self.head_dim // 2


@dataclass(frozen=True)
class ModelSpec:
    """The resolved text decoder: what the port must match, layer by layer."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    hidden_activation: str
    sliding_window: int
    pad_token_id: int
    bos_token_id: int | None
    eos_token_id: list[int]
    placeholder_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]
    # What the loader found beside the text decoder; reported, never run.
    inert_parts: tuple[str, ...] = field(default=(), compare=False)
    source: str = field(default="", compare=False)
    # The longest sequence the config allows (max_position_embeddings); a bound on prompt plus new
    # tokens and on the KV length. Not part of the numerics, so not part of the spec hash.
    max_positions: int | None = field(default=None, compare=False)
    # Per-layer input embeddings (E2B/E4B): width of each layer's slice of the packed table, 0 if none.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    moe: MoESpec | None = None
    model_type: str = field(default="gemma4_unified", compare=False)
    # Per attention type, the layer transformers marks "store" (its cache is what KV-shared layers
    # and an assistant read); derived from the layers, so not part of the spec hash.
    kv_store: dict = field(default_factory=dict, compare=False)

    @property
    def is_family(self) -> bool:
        """Read by transformers' modeling_gemma4 (not the unified 12B's module)."""
        return self.model_type in FAMILY_MODEL_TYPES

    @property
    def uses_family_blocks(self) -> bool:
        """The port runs it with the family's decoder (per-layer inputs, KV-shared attention,
        experts where the spec has them): a gemma4 model, or a unified one with KV sharing."""
        return self.is_family or any(layer.kv_source is not None for layer in self.layers)

    def mlp_size(self, layer: LayerSpec) -> int:
        return layer.intermediate_size or self.intermediate_size

    @property
    def shared_layers(self) -> list[int]:
        return [layer.index for layer in self.layers if layer.kv_source is not None]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def full_layers(self) -> list[int]:
        return [layer.index for layer in self.layers if not layer.is_sliding]

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("source", "inert_parts", "max_positions", "model_type", "kv_store"):
            d.pop(key)
        # Family fields at their defaults are left out, so a 12B's spec hash is what it always was.
        for key, default in (("per_layer_input_size", 0), ("per_layer_vocab_size", 0), ("moe", None)):
            if d[key] == default:
                d.pop(key)
        for layer in d["layers"]:
            for key in ("kv_source", "intermediate_size"):
                if layer[key] is None:
                    layer.pop(key)
        return d

    def spec_hash(self) -> str:
        """Hash of everything the numerics depend on (not where the config was read from)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe_inert(self) -> str:
        if not self.inert_parts:
            return "text-only config: no vision or audio parts"
        if self.is_family:
            return (f"{', '.join(self.inert_parts)} present but not run: the port runs the text decoder "
                    "(model.language_model) only; the encoder towers' weights are loaded by the reference, "
                    "never by the port")
        return (
            f"{', '.join(self.inert_parts)} present but inert: this is the encoder-free unified "
            "checkpoint (no vision or audio encoder tower weights exist); the port runs "
            "model.language_model only"
        )


def _resolve_with_transformers(text: dict, source: str, family: bool = False):
    """Let transformers resolve per_layer_config exactly as the reference model will."""
    from transformers import Gemma4TextConfig, Gemma4UnifiedTextConfig

    kwargs = {k: v for k, v in text.items() if k not in ("model_type", "transformers_version")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (Gemma4TextConfig if family else Gemma4UnifiedTextConfig)(**kwargs)
    except Exception as exc:  # transformers raises several types for bad configs
        raise ConfigError(f"{source}: transformers could not read text_config: {exc}") from exc


def _text_section(config: dict, source: str) -> tuple[dict, list[str], tuple[int, ...]]:
    """(the text decoder's config, the inert parts beside it, placeholder ids) for a model type."""
    model_type = config.get("model_type")
    if model_type in DRAFTER_MODEL_TYPES:
        raise unsupported(source, "model_type", model_type, "drafter (assistant) models read another "
                           "model's KV states and are not a standalone decoder")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type is {model_type!r}, expected one of {SUPPORTED_MODEL_TYPES}. "
            "Point the tool at a Gemma-4 checkpoint (e.g. google/gemma-4-12B-it or google/gemma-4-31B-it)."
        )
    if model_type not in ("gemma4_unified", "gemma4"):
        return config, [], ()
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: model_type {model_type} needs a text_config object")
    inert = [part for part in ("vision_config", "audio_config") if config.get(part)]
    return text, inert, _placeholder_ids(config, source)


def _layer_spec(tc, i: int, layer_type: str, source: str) -> LayerSpec:
    if layer_type not in (SLIDING, FULL):
        raise unsupported(source, f"layer_types[{i}]", layer_type, "unknown attention type")
    per_layer = tc.per_layer_config[i]
    rope = (tc.rope_parameters or {}).get(layer_type) if isinstance(tc.rope_parameters, dict) else None
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise bad_value(source, f"rope_parameters.{layer_type}", rope, "must be an object with rope_theta "
                         f"for the {layer_type} layers")
    is_full = layer_type == FULL
    layer = LayerSpec(
        index=i,
        type=layer_type,
        head_dim=int(per_layer.head_dim),
        q_heads=int(tc.num_attention_heads),
        kv_heads=int(per_layer.num_key_value_heads),
        k_eq_v=bool(tc.attention_k_eq_v and is_full),
        window=None if is_full else int(tc.sliding_window),
        rope_type=str(rope.get("rope_type", "default")),
        rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=float(1.0 if rope.get("partial_rotary_factor") is None
                                    else rope["partial_rotary_factor"]),
    )
    if layer.rope_type not in ("default", "proportional"):
        raise unsupported(source, f"rope_parameters.{layer_type}.rope_type",
                           layer.rope_type, "only default and proportional rope are implemented")
    return layer


def spec_from_config_dict(config: dict, source: str = "<config>") -> ModelSpec:
    """Resolve a Gemma-4 config dict (gemma4_unified, gemma4, or their bare text configs) into a
    ModelSpec."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a JSON object (a config.json), got a JSON "
                          f"{type(config).__name__}; pass the model's config.json")
    text, inert, placeholders = _text_section(config, source)
    family = config.get("model_type") in FAMILY_MODEL_TYPES
    validate_text_config(text, source, family)
    tc = _resolve_with_transformers(text, source, family)
    layers = [_layer_spec(tc, i, t, source) for i, t in enumerate(tc.layer_types)]
    refuse_heterogeneous_types(layers, source)
    layers = kv_sharing_layers(tc, layers, source)
    extra = family_fields(tc, source) if family else {}
    eos = tc.eos_token_id
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return ModelSpec(
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        vocab_size=int(tc.vocab_size),
        rms_norm_eps=float(tc.rms_norm_eps),
        final_logit_softcapping=(None if tc.final_logit_softcapping is None
                                 else float(tc.final_logit_softcapping)),
        hidden_activation=str(tc.hidden_activation),
        sliding_window=int(tc.sliding_window),
        pad_token_id=int(tc.pad_token_id if tc.pad_token_id is not None else 0),
        bos_token_id=tc.bos_token_id,
        eos_token_id=eos_list,
        placeholder_token_ids=placeholders,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", tc.tie_word_embeddings)),
        layers=tuple(layers),
        inert_parts=tuple(inert),
        source=source,
        max_positions=_max_positions(text, tc),
        model_type=str(config["model_type"]),
        kv_store=kv_store_layers(tc, source),
        **extra,
    )


def _max_positions(text: dict, tc) -> int | None:
    value = text.get("max_position_embeddings", getattr(tc, "max_position_embeddings", None))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _placeholder_ids(config: dict, source: str) -> tuple[int, ...]:
    ids = []
    for key in DEFAULT_PLACEHOLDER_KEYS:
        value = config.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad_value(source, key, value, "must be a non-negative token id")
            ids.append(value)
    return tuple(ids)


def load_spec(path: str | Path) -> ModelSpec:
    """Read a config.json file, or the config.json inside a checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path}: config.json {not_a_file(path)}. Pass a checkpoint directory that holds config.json "
            "(as written by save_pretrained) or --config pointing at the file."
        )
    config = read_json_file(path, "config", ConfigError, "re-download or re-save the config", "utf-8-sig")
    return spec_from_config_dict(config, source=str(path))


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None
