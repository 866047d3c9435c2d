"""config.json -> resolved per-layer spec of the Gemma-4 text decoder; validation; memory estimate."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")
SLIDING = "sliding_attention"
FULL = "full_attention"
# The multimodal wrapper swaps these placeholder ids for the pad id before embedding (DESIGN §2.7).
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

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def full_layers(self) -> list[int]:
        return [layer.index for layer in self.layers if not layer.is_sliding]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("source")
        d.pop("inert_parts")
        return d

    def spec_hash(self) -> str:
        """Hash of everything the numerics depend on (not where the config was read from)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe_inert(self) -> str:
        if not self.inert_parts:
            return "text-only config: no vision or audio parts"
        return (
            f"{', '.join(self.inert_parts)} present but inert: this is the encoder-free unified "
            "checkpoint (no vision or audio encoder tower weights exist); the port runs "
            "model.language_model only"
        )


def _unsupported(source: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(
        f"{source}: unsupported config key {key}={value!r}: {why}. The port covers the Gemma-4 "
        "12B/31B-style dense text decoder; use a checkpoint without this feature."
    )


def _validate_text_config(text: dict, source: str) -> None:
    if int(text.get("num_kv_shared_layers", 0) or 0) != 0:
        raise _unsupported(source, "num_kv_shared_layers", text["num_kv_shared_layers"],
                           "KV sharing between layers is not implemented")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(key):
            raise _unsupported(source, key, text[key], "per-layer embeddings are not implemented")
    if text.get("use_bidirectional_attention") == "all":
        raise _unsupported(source, "use_bidirectional_attention", "all",
                           "the port is a causal decoder; only None or \"vision\" are supported")
    for key in ("enable_moe_block", "num_experts", "num_local_experts", "moe_intermediate_size",
                "top_k_experts"):
        if text.get(key):
            raise _unsupported(source, key, text[key], "mixture-of-experts layers are not implemented")
    if text.get("attention_bias"):
        raise _unsupported(source, "attention_bias", True, "the port's projections have no bias")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise _unsupported(source, "hidden_activation", act, "only gelu_pytorch_tanh is implemented")


def _resolve_with_transformers(text: dict, source: str):
    """Let transformers resolve per_layer_config exactly as the reference model will."""
    from transformers import Gemma4UnifiedTextConfig

    kwargs = {k: v for k, v in text.items() if k not in ("model_type", "transformers_version")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Gemma4UnifiedTextConfig(**kwargs)
    except Exception as exc:  # transformers raises several types for bad configs
        raise ConfigError(f"{source}: transformers could not read text_config: {exc}") from exc


def spec_from_config_dict(config: dict, source: str = "<config>") -> ModelSpec:
    """Resolve a gemma4_unified (or bare gemma4_unified_text) config dict into a ModelSpec."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type is {model_type!r}, expected one of {SUPPORTED_MODEL_TYPES}. "
            "Point the tool at a Gemma-4 unified checkpoint (e.g. google/gemma-4-12B-it)."
        )
    inert: list[str] = []
    if model_type == "gemma4_unified":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type gemma4_unified needs a text_config object")
        for part in ("vision_config", "audio_config"):
            if config.get(part):
                inert.append(part)
        placeholders = tuple(int(config[k]) for k in DEFAULT_PLACEHOLDER_KEYS
                             if config.get(k) is not None)
    else:
        text = config
        placeholders = ()
    _validate_text_config(text, source)
    tc = _resolve_with_transformers(text, source)

    layers = []
    for i, layer_type in enumerate(tc.layer_types):
        if layer_type not in (SLIDING, FULL):
            raise _unsupported(source, f"layer_types[{i}]", layer_type, "unknown attention type")
        per_layer = tc.per_layer_config[i]
        rope = tc.rope_parameters[layer_type]
        is_full = layer_type == FULL
        layers.append(LayerSpec(
            index=i,
            type=layer_type,
            head_dim=int(per_layer.head_dim),
            q_heads=int(tc.num_attention_heads),
            kv_heads=int(per_layer.num_key_value_heads),
            k_eq_v=bool(tc.attention_k_eq_v and is_full),
            window=None if is_full else int(tc.sliding_window),
            rope_type=str(rope.get("rope_type", "default")),
            rope_theta=float(rope["rope_theta"]),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        ))
        if layers[-1].rope_type not in ("default", "proportional"):
            raise _unsupported(source, f"rope_parameters.{layer_type}.rope_type",
                               layers[-1].rope_type, "only default and proportional rope are implemented")
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
    )


def load_spec(path: str | Path) -> ModelSpec:
    """Read a config.json file, or the config.json inside a checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path}: config.json not found. Pass a checkpoint directory that holds config.json "
            "(as written by save_pretrained) or --config pointing at the file."
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); re-download or re-save the config") from exc
    return spec_from_config_dict(config, source=str(path))


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None
