"""The tiny fixture: random Gemma-4 checkpoints built through transformers' own classes, with
weights drawn so greedy decoding has clear top-1 margins, and a cache of them shared by tests,
benchmarks and `--model tiny` (built once per seed and config, safe under concurrent first use)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import torch

from harness import FIXTURES_DIR
from harness.base.atomic import atomic_directory
from harness.base.errors import (CheckpointError, HarnessInputError, InputFileError, OutputError, not_a_file, os_problem,
                                 read_json_file, wrapped_os_error)
from harness.base.leftovers import clean_stale_temps
from harness.inputs.spec import TRANSFORMERS_CLASSES

ROW_NORM_SPREAD = 0.5
POST_NORM_LOW, POST_NORM_SPAN = 2.0, 3.0
TINY_BUILDER_VERSION = 3
TINY_CONFIG = FIXTURES_DIR / "configs" / "gemma-4-tiny.json"
# Tiny transformers-built checkpoints of the family's variants (fixtures/configs/tiny/).
TINY_FAMILY = {name: FIXTURES_DIR / "configs" / "tiny" / f"gemma-4-tiny-{name}.json"
               for name in ("31b", "e2b", "e4b", "26b-a4b")}
# The tiny 12B with KV sharing (gemma4_unified has it too: layers 8-11 read layers 7 and 5's caches,
# with the double-wide MLP on them): the unified variant of the family's KV-sharing faults and census.
TINY_UNIFIED_KV = FIXTURES_DIR / "configs" / "tiny" / "gemma-4-tiny-unified-kv.json"
TINY_CLASSES = TRANSFORMERS_CLASSES  # the classes per model type (harness/inputs/spec.py)


def cache_dir() -> Path:
    """$GEMMA_PARITY_CACHE (an empty value counts as unset), else ~/.cache/gemma-parity."""
    if os.environ.get("GEMMA_PARITY_CACHE", "").strip():
        return Path(os.environ["GEMMA_PARITY_CACHE"])
    try:
        return Path.home() / ".cache" / "gemma-parity"
    except RuntimeError:
        raise OutputError("no home directory to keep the tiny-model cache in; set GEMMA_PARITY_CACHE "
                          "to a writable directory") from None


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0, config_path: str | Path = TINY_CONFIG,
                          logit_scale: float = 1.0, overwrite: bool = False) -> Path:
    """Write a random Gemma-4 checkpoint for the config file at `config_path` (build_checkpoint)."""
    config = read_json_file(Path(config_path), "config", CheckpointError, "pass a Gemma-4 unified config.json")
    return build_checkpoint(out_dir, config, seed, logit_scale=logit_scale, overwrite=overwrite)


WEIGHTS = ("margins", "init")


def build_checkpoint(out_dir: str | Path, config: dict, seed: int = 0, weights: str = "margins",
                     logit_scale: float = 1.0, overwrite: bool = False) -> Path:
    """Write a random checkpoint for a Gemma-4 config dict (a config.json's content, or a
    transformers config's to_dict()) the way a published one is saved: transformers' own class for
    the model type (the conditional-generation class for gemma4 and gemma4_unified, with whatever
    vision and audio towers the config has) and save_pretrained.

    Deterministic from `seed`. weights="margins": sized so greedy logits have clear top-1 margins
    (embedding rows of unit scale; projections at 1/sqrt(fan_in)), norm weights and layer_scalar
    drawn away from 1.0 so that `1 + weight` or a dropped scalar shows. weights="init": the class's
    own initialisation (what transformers' tests build), seeded.
    """
    import transformers

    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: one of {WEIGHTS}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir}: already exists and is not empty; choose a new directory "
                              "(a checkpoint is never overwritten silently)")
    config = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    torch.manual_seed(seed)  # parts randomize_for_margins leaves alone (the towers), and "init"
    config_cls, model_cls = TRANSFORMERS_CLASSES[config.get("model_type", "gemma4_unified")]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    if weights == "margins":
        randomize_for_margins(model, seed, logit_scale)
    _save_atomically(model, out_dir, overwrite)
    return out_dir


def randomize_for_margins(model, seed: int, logit_scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            if name.endswith("layer_scalar"):
                # |s - 1| >= 0.2 so that a missing layer_scalar is a visible error
                sign = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
                p.fill_(1.0 + sign * (0.2 + 0.3 * torch.rand((), generator=gen).item()))
            elif name.endswith("embed_tokens.weight"):
                # Row norms spread log-normally: a few rows dominate the tied lm_head, which widens
                # the top-1/top-2 gaps the way a trained model's peaked distributions do.
                rows = torch.exp(ROW_NORM_SPREAD * torch.randn(p.shape[0], 1, generator=gen))
                p.copy_(torch.randn(p.shape, generator=gen) * rows * logit_scale)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # With attention scaling 1.0, unit q/k norms give scores of std sqrt(head_dim): a
                # near-argmax softmax whose winner bf16 noise flips. Softer attention keeps the
                # random model well conditioned, and 0.3-0.6 is still far from 1.0.
                p.copy_(0.3 + 0.3 * torch.rand(p.shape, generator=gen))
            elif name.endswith(("language_model.norm.weight", "model.norm.weight")) and ".layers." not in name:
                # The final norm with random signs: with a tied lm_head the residual stream's copy
                # of the current token's embedding otherwise wins every step (a model that repeats
                # one token forever); signed weights cancel that self-logit, so greedy decode moves.
                signs = torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0)
                p.copy_(signs * (0.6 + 0.8 * torch.rand(p.shape, generator=gen)))
            elif name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                # Sublayer outputs comparable to the sqrt(hidden)-scaled embedding, so the residual
                # stream is not just the current token (which makes a model that copies its input).
                p.copy_(POST_NORM_LOW + POST_NORM_SPAN * torch.rand(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=gen))
            elif name.endswith("embed_tokens_per_layer.weight"):
                # The packed per-layer table at a scale where its share of each layer's input shows.
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                # Away from 1.0, so that a dropped scale is a visible error.
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif p.dim() in (2, 3) and p.is_floating_point():  # 3: the stacked experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _save_atomically(model, out_dir: Path, overwrite: bool) -> None:
    """save_pretrained into a temp dir beside out_dir, then rename: nothing half written remains."""
    from harness.base.progress import third_party_bars

    third_party_bars()
    try:
        with atomic_directory(out_dir, replace=overwrite) as tmp:
            try:
                model.save_pretrained(tmp, safe_serialization=True)
            except Exception as exc:  # safetensors' own error type for a full disk
                if wrapped_os_error(exc) is None:
                    raise
                raise _cache_problem(wrapped_os_error(exc), out_dir) from None
    except HarnessInputError:
        # Another process (a pytest-xdist worker) finished the same deterministic build first.
        if not (out_dir / "config.json").is_file():
            raise


def tiny_checkpoint_path(seed: int = 0, config_path: Path = TINY_CONFIG) -> Path:
    """Where the cached tiny checkpoint for `seed` (and config) lives (built or not)."""
    # The builder's version is part of the key: a change in how weights are drawn must not reuse
    # a checkpoint cached by an older build.
    if not TINY_CONFIG.is_file():
        raise InputFileError(f"{TINY_CONFIG}: the tiny model's config is not installed ({not_a_file(TINY_CONFIG)}): "
                             "this gemma-parity was installed without its fixtures; reinstall it from the "
                             "repository (pip install .) or run it from a checkout")
    digest = hashlib.sha256(config_path.read_bytes() + f"builder-{TINY_BUILDER_VERSION}".encode()).hexdigest()[:10]
    stem = "tiny" if config_path == TINY_CONFIG else config_path.stem
    return cache_dir() / f"{stem}-{digest}-seed{seed}"


def _cache_problem(exc: OSError, where: Path) -> OutputError:
    return OutputError(os_problem(exc, where, "cannot use the tiny-model cache") +
                       "; or point GEMMA_PARITY_CACHE at a writable directory")


def tiny_checkpoint(seed: int = 0, config_path: Path = TINY_CONFIG) -> Path:
    """The cached tiny checkpoint for `seed` (12B-shaped unless another tiny config is given),
    built on first use."""
    path = tiny_checkpoint_path(seed, config_path)
    return _cached(path, lambda: build_tiny_checkpoint(path, seed=seed, config_path=config_path))


def cached_checkpoint(config: dict, seed: int = 0, weights: str = "margins", name: str = "config") -> Path:
    """build_checkpoint's checkpoint for a config dict, cached beside the tiny ones (keyed by the
    config's canonical JSON, the seed, the weights and the builder's version), built on first use."""
    blob = json.dumps(config, sort_keys=True).encode() + f"builder-{TINY_BUILDER_VERSION}-{weights}".encode()
    path = cache_dir() / f"{name}-{hashlib.sha256(blob).hexdigest()[:10]}-seed{seed}"
    return _cached(path, lambda: build_checkpoint(path, config, seed=seed, weights=weights))


def _cached(path: Path, build) -> Path:
    """Safe under concurrent first use (pytest-xdist workers, parallel CI jobs): builders take an
    exclusive lock on a file beside the cache entry, and whoever comes second finds the entry
    complete and uses it. The entry appears by one rename, so `config.json` means complete."""
    if (path / "config.json").is_file():
        return path
    cache = path.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f".lock-{path.name}", "a")
    except FileExistsError:
        raise OutputError(f"{cache}: the tiny-model cache is not a directory; point GEMMA_PARITY_CACHE "
                          "at a directory") from None
    except OSError as exc:
        raise _cache_problem(exc, cache) from None
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            clean_stale_temps(cache)
            if path.exists():
                raise CheckpointError(f"{path}: an incomplete tiny-model cache entry (no config.json); "
                                      "delete it and run again")
            build()
    return path
