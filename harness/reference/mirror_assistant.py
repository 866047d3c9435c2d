"""A tiny target + assistant pair whose drafts are mostly accepted (the "mirror" pair), so that the
acceptance judge has something to lose: a drafter capped at one accepted token per verify falls far
below transformers' assisted generation on it (the fitted pairs of tiny_assistant.py accept < 1).

Both are built through transformers' own classes from a tiny target (harness.inputs.tiny):
- the target: the tiny target with its attention quieted (post-attention norm x QUIET) in every
  layer except its "store" layers (the last of each attention type, whose keys and values the
  assistant reads), so its next token depends mostly on the current token and on those two layers;
- the assistant: the target's own layers mirrored (hidden size = the target's, one assistant layer
  per target layer, same type, the target's query/output projections, MLP, norms and layer
  scalars; its tied head the target's embedding); `pre_projection` passes the target's scaled
  embedding through and drops the hidden state, `post_projection` is the identity. Run on the
  target's store-layer keys, it computes what the target would at that position (exactly for the
  quiet layers, without the current token's own key for the store layers): its drafts are the
  target's greedy tokens most of the time. No masked head (the fitted pairs cover it).

Deterministic from the seed; cached like harness.inputs.tiny (docs/speculative.md#the-mirror-pair)."""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path

import torch

from harness.inputs.tiny import TINY_CONFIG, _save_atomically, cache_dir, tiny_checkpoint
from harness.reference.assistant import load_target
from harness.reference.tiny_assistant import assistant_class

MIRROR_VERSION = 1
QUIET = 0.01  # the quiet layers' attention output scale (not zero: every capture point stays non-trivial)
ASSISTANT_TYPES = {"gemma4_unified": ("gemma4_unified_assistant", "gemma4_unified_text"),
                   "gemma4": ("gemma4_assistant", "gemma4_text")}


def store_layers(layer_types: list[str]) -> set[int]:
    """The last layer of each attention type: the layers an assistant's layers read."""
    return {max(i for i, t in enumerate(layer_types) if t == typ) for typ in set(layer_types)}


def quiet_target(target) -> None:
    """Scale the attention output of every non-store layer of `target` by QUIET (in place)."""
    text = target.model.language_model
    keep = store_layers(list(target.config.get_text_config().layer_types))
    with torch.no_grad():
        for i, layer in enumerate(text.layers):
            if i not in keep:
                layer.post_attention_layernorm.weight.mul_(QUIET)


def mirror_config(target_config: dict) -> dict:
    """The assistant config mirroring a target config.json (its text part, every layer KV-shared)."""
    model_type, text_type = ASSISTANT_TYPES[target_config["model_type"]]
    text = dict(target_config["text_config"], model_type=text_type)
    text["num_kv_shared_layers"] = text["num_hidden_layers"]
    for key in ("enable_moe_block", "hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        text.pop(key, None)
    return {"model_type": model_type, "text_config": text, "backbone_hidden_size": text["hidden_size"],
            "use_ordered_embeddings": False, "num_centroids": 1, "centroid_intermediate_top_k": 1,
            "tie_word_embeddings": True}


def mirror_assistant(target, config: dict):
    """A transformers assistant whose weights are the (quieted) target's, as the module doc says."""
    config_cls, model_cls = assistant_class(config)
    assistant = model_cls(config_cls(**{k: v for k, v in config.items() if k != "model_type"})).eval()
    state = {"model." + k: v for k, v in target.model.language_model.state_dict().items()
             if not (k.startswith("layers.") and any(p in k for p in ("k_proj", "v_proj", "k_norm", "v_norm")))}
    h = config["backbone_hidden_size"]
    with torch.no_grad():
        result = assistant.load_state_dict(state, strict=False)
        left = set(result.missing_keys) - {"lm_head.weight", "pre_projection.weight", "post_projection.weight"}
        if left or result.unexpected_keys:
            raise RuntimeError(f"mirror assistant: weights not mirrored {sorted(left)}, unexpected {result.unexpected_keys}")
        assistant.pre_projection.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
        assistant.post_projection.weight.copy_(torch.eye(h))
        assistant.lm_head.weight.copy_(assistant.model.embed_tokens.weight)
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return assistant


def build_mirror_pair(out: Path, source: Path) -> None:
    """Write the mirror pair of the tiny target at `source` under out/target and out/assistant."""
    target = load_target(source)
    quiet_target(target)
    assistant = mirror_assistant(target, mirror_config(json.loads((source / "config.json").read_text())))
    _save_atomically(target, out / "target", False)
    _save_atomically(assistant, out / "assistant", False)


def mirror_pair(seed: int = 0, target_config: Path = TINY_CONFIG) -> tuple[Path, Path]:
    """(target, assistant) checkpoint directories of the mirror pair, built and cached on first use."""
    source = tiny_checkpoint(seed, target_config)
    digest = hashlib.sha256(source.name.encode() + f"mirror-{MIRROR_VERSION}-{QUIET}".encode()).hexdigest()[:10]
    path = cache_dir() / f"mirror-{source.name}-{digest}"
    done = path / "assistant" / "config.json"
    if not done.is_file():
        with open(cache_dir() / f".lock-{path.name}", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if not done.is_file():
                build_mirror_pair(path, source)
    return path / "target", path / "assistant"
