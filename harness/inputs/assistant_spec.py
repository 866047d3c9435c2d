"""Gemma-4's assistant (drafter) config -> AssistantSpec, validated against its target's ModelSpec.

The assistant (transformers' gemma4_assistant / gemma4_unified_assistant) is a small decoder whose
every layer is KV-shared: it has query projections only and reads the target's keys and values of
the target's "store" layer of the same attention type (spec.kv_store). Its input is the target's
scaled token embedding concatenated with the target's last hidden state (the final norm's output)
through `pre_projection`; it returns `post_projection` of its own last hidden state for its next
step, and scores the vocabulary with its tied head, or through the centroid-masked head
(`use_ordered_embeddings`: the top `centroid_intermediate_top_k` of `num_centroids` clusters, each
cluster's tokens listed by `token_ordering`). docs/speculative.md has the whole design."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from harness.base.errors import ConfigError, not_a_file, read_json_file
from harness.inputs.spec import DRAFTER_MODEL_TYPES, LayerSpec, ModelSpec, _layer_spec
from harness.inputs.validation import SLIDING

# Which target model types each assistant model type drafts for.
ASSISTANT_TARGETS = {"gemma4_unified_assistant": ("gemma4_unified", "gemma4_unified_text"),
                     "gemma4_assistant": ("gemma4", "gemma4_text")}


@dataclass(frozen=True)
class AssistantSpec:
    """The resolved assistant: its layers (each with kv_source = the target layer it reads)."""

    model_type: str
    hidden_size: int
    backbone_hidden_size: int  # the target's hidden size (pre_projection takes twice this)
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    layers: tuple[LayerSpec, ...]
    ordered: bool  # use_ordered_embeddings: the centroid-masked head
    num_centroids: int
    top_k_centroids: int
    source: str = ""

    @property
    def per_centroid(self) -> int:
        return self.vocab_size // self.num_centroids

    @property
    def candidates(self) -> int:
        """Tokens the masked head scores per row: top_k clusters of per_centroid tokens (static)."""
        return self.top_k_centroids * self.per_centroid

    def bytes_per_rank(self, tp: int, dtype_bytes: int) -> int:
        """Device bytes of one rank's drafter (harness/port/drafter.py): query/output projections and the
        MLP split across ranks; norms, head, projections, centroids replicated; token_ordering as
        int64. No KV cache: it reads the target's."""
        h, n = self.hidden_size, 0
        for layer in self.layers:
            n += (2 * h * layer.q_heads * layer.head_dim + 3 * h * self.intermediate_size) // tp
            n += layer.head_dim + 4 * h + 1  # q_norm, four norms, layer_scalar
        n += self.vocab_size * h + h + 3 * self.backbone_hidden_size * h
        n += self.num_centroids * h if self.ordered else 0
        return n * dtype_bytes + (8 * self.vocab_size if self.ordered else 0)


def _key_problem(source: str, key: str, value, want: str) -> ConfigError:
    return ConfigError(f"{source}: assistant config key {key}={value!r} {want}. Use the assistant "
                       "checkpoint published with this target (its config.json as saved).")


def _resolve(config: dict, source: str):
    """transformers' own assistant config class (5.24: all layers "reuse")."""
    import transformers

    name = "Gemma4UnifiedAssistantConfig" if config["model_type"] == "gemma4_unified_assistant" else "Gemma4AssistantConfig"
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "architectures")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return getattr(transformers, name)(**kwargs)
    except Exception as exc:  # transformers raises several types for bad configs
        raise ConfigError(f"{source}: transformers could not read the assistant config: {exc}") from exc


def assistant_spec_from_dict(config: dict, target: ModelSpec, source: str = "<assistant config>") -> AssistantSpec:
    """Resolve an assistant config and check that it drafts for `target`, naming the key that does not fit."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in DRAFTER_MODEL_TYPES:
        raise ConfigError(f"{source}: model_type is {model_type!r}, expected one of {DRAFTER_MODEL_TYPES}: "
                          "--assistant takes a Gemma-4 assistant (drafter) checkpoint")
    if target.model_type not in ASSISTANT_TARGETS[model_type]:
        raise _key_problem(source, "model_type", model_type, f"drafts for {ASSISTANT_TARGETS[model_type][0]} "
                           f"targets, and the target is {target.model_type}")
    if not isinstance(config.get("text_config"), dict):
        raise ConfigError(f"{source}: an assistant config needs a text_config object")
    cfg = _resolve(config, source)
    tc = cfg.text_config
    _check_against_target(cfg, tc, target, source)
    layers = tuple(_reading_layer(tc, i, t, target, source) for i, t in enumerate(tc.layer_types))
    return AssistantSpec(model_type=model_type, hidden_size=int(tc.hidden_size),
                         backbone_hidden_size=int(cfg.backbone_hidden_size), intermediate_size=int(tc.intermediate_size),
                         vocab_size=int(tc.vocab_size), rms_norm_eps=float(tc.rms_norm_eps), layers=layers,
                         ordered=bool(cfg.use_ordered_embeddings), num_centroids=int(cfg.num_centroids),
                         top_k_centroids=int(cfg.centroid_intermediate_top_k), source=source)


def _check_against_target(cfg, tc, target: ModelSpec, source: str) -> None:
    if cfg.backbone_hidden_size != target.hidden_size:
        raise _key_problem(source, "backbone_hidden_size", cfg.backbone_hidden_size,
                           f"must equal the target's hidden_size={target.hidden_size}")
    if tc.vocab_size != target.vocab_size:
        raise _key_problem(source, "text_config.vocab_size", tc.vocab_size,
                           f"must equal the target's vocab_size={target.vocab_size}")
    if tc.num_kv_shared_layers != tc.num_hidden_layers:
        raise _key_problem(source, "text_config.num_kv_shared_layers", tc.num_kv_shared_layers,
                           f"must equal num_hidden_layers={tc.num_hidden_layers} (every assistant layer reads the target's cache)")
    for key in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
        if getattr(tc, key, None):
            raise _key_problem(source, f"text_config.{key}", getattr(tc, key), "must be unset in an assistant")
    if cfg.use_ordered_embeddings:
        if cfg.num_centroids < 1 or tc.vocab_size % cfg.num_centroids:
            raise _key_problem(source, "num_centroids", cfg.num_centroids,
                               f"must divide the vocabulary ({tc.vocab_size}) into equal clusters")
        if not 1 <= cfg.centroid_intermediate_top_k <= cfg.num_centroids:
            raise _key_problem(source, "centroid_intermediate_top_k", cfg.centroid_intermediate_top_k,
                               f"must be in [1, num_centroids={cfg.num_centroids}]")


def _reading_layer(tc, i: int, layer_type: str, target: ModelSpec, source: str) -> LayerSpec:
    """Assistant layer i as a LayerSpec reading the target's store layer of its type; its heads
    must fit that layer's keys (head width, KV heads dividing the query heads)."""
    if layer_type not in target.kv_store:
        raise _key_problem(source, f"text_config.layer_types[{i}]", layer_type,
                           f"is an attention type the target has no layer of ({sorted(target.kv_store)})")
    store = target.layers[target.kv_store[layer_type]]
    own = _layer_spec(tc, i, layer_type, source)
    if own.head_dim != store.head_dim:
        key = "head_dim" if layer_type == SLIDING else "global_head_dim"
        raise _key_problem(source, f"text_config.{key}", own.head_dim, f"must equal the width of the target's "
                           f"{layer_type} keys ({store.head_dim}, layer {store.index})")
    if own.q_heads % store.kv_heads:
        raise _key_problem(source, "text_config.num_attention_heads", own.q_heads,
                           f"must be a multiple of the target's {store.kv_heads} {layer_type} KV heads")
    return replace(own, kv_heads=store.kv_heads, k_eq_v=store.k_eq_v, kv_source=store.index)


def load_assistant_spec(path: str | Path, target: ModelSpec) -> AssistantSpec:
    """An assistant checkpoint directory's (or a config.json's) AssistantSpec against `target`."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{file}: the assistant's config.json {not_a_file(file)}; pass --assistant DIR, "
                          "the assistant checkpoint directory (config.json + *.safetensors)")
    config = read_json_file(file, "assistant config", ConfigError, "re-download or re-save it", "utf-8-sig")
    return assistant_spec_from_dict(config, target, source=str(file))
