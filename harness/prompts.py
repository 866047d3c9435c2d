"""Prompt files: a JSON list of token-id lists (or of strings, with a tokenizer), checked against
the spec's vocabulary before any model work."""

from __future__ import annotations

import json
from pathlib import Path

from harness import FIXTURES_DIR
from harness.errors import PromptError

DEFAULT_PROMPTS = FIXTURES_DIR / "prompts" / "default.json"
DEFAULT_NEW_TOKENS = 8


def load_prompts(path=None, checkpoint_dir=None) -> list[list[int]]:
    """A JSON list of token-id lists, or of strings when the checkpoint has a tokenizer."""
    path = Path(path) if path else DEFAULT_PROMPTS
    try:
        items = json.loads(path.read_text())
    except FileNotFoundError:
        raise PromptError(f"{path}: prompts file not found") from None
    except json.JSONDecodeError as exc:
        raise PromptError(f"{path}: not valid JSON ({exc}); expected a list of token-id lists") from exc
    if not isinstance(items, list) or not items:
        raise PromptError(f"{path}: expected a non-empty JSON list of prompts")
    prompts = []
    for k, item in enumerate(items):
        if isinstance(item, str):
            item = _tokenize(item, checkpoint_dir, path, k)
        if not isinstance(item, list) or not all(isinstance(t, int) for t in item):
            raise PromptError(f"{path}: prompt {k} must be a list of integer token ids (or a string "
                              "when the checkpoint has a tokenizer)")
        if not item:
            raise PromptError(f"{path}: prompt {k} is empty; give at least one token")
        prompts.append(item)
    return prompts


def _tokenize(text, checkpoint_dir, path, k) -> list[int]:
    has_tokenizer = checkpoint_dir and any(
        (Path(checkpoint_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if not has_tokenizer:
        raise PromptError(f"{path}: prompt {k} is a string but the checkpoint directory has no "
                          "tokenizer; give token ids instead")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir)(text)["input_ids"]


def validate_prompt_ids(spec, prompts, source=None) -> None:
    where = f"{source or DEFAULT_PROMPTS}: "
    allowed = set(spec.placeholder_token_ids)
    for k, prompt in enumerate(prompts):
        if not prompt:
            raise PromptError(f"{where}prompt {k} is empty; give at least one token")
        for pos, t in enumerate(prompt):
            if not (0 <= t < spec.vocab_size) and t not in allowed:
                raise PromptError(f"{where}prompt {k}: token id {t} at position {pos} is outside the "
                                  f"vocabulary [0, {spec.vocab_size}); check the prompts file")
