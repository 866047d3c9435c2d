"""Prompt files: a JSON list of token-id lists (or of strings, with a tokenizer), checked against
the spec's vocabulary, the prefill buckets and the KV length before any model work."""

from __future__ import annotations

from pathlib import Path

from harness import FIXTURES_DIR
from harness.base.errors import InputFileError, PromptError, not_a_file, read_json_file

DEFAULT_PROMPTS = FIXTURES_DIR / "prompts" / "default.json"
DEFAULT_NEW_TOKENS = 8


def _read_json(path: Path):
    # utf-8-sig: a byte-order mark is harmless
    return read_json_file(path, "prompts file", PromptError, "save the prompts file as UTF-8 JSON: a list of "
                          "token-id lists", "utf-8-sig")


def is_token_id(t) -> bool:
    """An int that is not a bool (JSON true/false are not token ids)."""
    return isinstance(t, int) and not isinstance(t, bool)


def load_prompts(path=None, checkpoint_dir=None) -> list[list[int]]:
    """A JSON list of token-id lists, or of strings when the checkpoint has a tokenizer."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if path == DEFAULT_PROMPTS and not path.is_file():
        raise InputFileError(f"{path}: the default prompts are not installed ({not_a_file(path)}): this "
                             "gemma-parity was installed without its fixtures; pass --prompts FILE, or reinstall it "
                             "from the repository (pip install .)")
    if path.is_dir():
        raise InputFileError(f"{path}: is a directory; give the prompts file (a JSON list of token-id lists)")
    items = _read_json(path)
    if not isinstance(items, list) or not items:
        raise PromptError(f"{path}: expected a non-empty JSON list of prompts")
    prompts = []
    for k, item in enumerate(items):
        if isinstance(item, str):
            if not item.strip():
                raise PromptError(f"{path}: prompt {k} is an empty string; give some text or token ids")
            item = _tokenize(item, checkpoint_dir, path, k)
        if not isinstance(item, list) or not all(is_token_id(t) for t in item):
            raise PromptError(f"{path}: prompt {k} must be a list of integer token ids (or a string "
                              "when the checkpoint has a tokenizer); booleans and numbers with a "
                              "fraction are not token ids")
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

    try:
        return list(AutoTokenizer.from_pretrained(checkpoint_dir)(text)["input_ids"])
    except Exception as exc:  # a broken tokenizer file is the checkpoint's problem, not a bug here
        raise PromptError(f"{checkpoint_dir}: the tokenizer could not encode prompt {k} of {path} "
                          f"({type(exc).__name__}: {exc}); fix the tokenizer files or give token ids") from None


def _where_and_fix(source, vocab_size: int) -> tuple[str, str]:
    """Who the prompts came from, and what fixes an id outside the vocabulary there."""
    if source is None:
        return (f"the default prompts file {DEFAULT_PROMPTS} (used because no --prompts was given): ",
                f"this model's vocabulary is smaller than the default prompts assume; pass --prompts FILE "
                f"with token ids below {vocab_size}")
    if str(source).startswith("golden"):
        return f"{source}: ", "the golden was made with another vocabulary; regenerate it for this model"
    return f"{source}: ", "check the prompts file"


def validate_prompt_ids(spec, prompts, source=None) -> None:
    where, fix = _where_and_fix(source, spec.vocab_size)
    allowed = set(spec.placeholder_token_ids)
    for k, prompt in enumerate(prompts):
        if not prompt:
            raise PromptError(f"{where}prompt {k} is empty; give at least one token")
        for pos, t in enumerate(prompt):
            if not is_token_id(t):
                raise PromptError(f"{where}prompt {k}: {t!r} at position {pos} is not an integer token id")
            if not (0 <= t < spec.vocab_size) and t not in allowed:
                raise PromptError(f"{where}prompt {k}: token id {t} at position {pos} is outside the "
                                  f"vocabulary [0, {spec.vocab_size}); {fix}")


def kv_positions_used(n: int, new_tokens: int, draft: int = 0) -> int:
    """The one count of the KV positions a run uses (every guard of the commands, the engine, the
    batch, speculation and bench compares it with the KV length): an n-token prompt's n (a prompt is
    prefilled whole even at 0 new tokens), then every chosen token but the last (it is never written
    back). With drafts of `draft` tokens (speculative decoding) every verify is padded to draft + 1
    rows (Engine.verify): the last, at position n + new_tokens - 2 at most, needs `draft` slots more
    (no verify runs for a single new token)."""
    return n + max(new_tokens, 1) - 1 + (draft if new_tokens > 1 else 0)


def check_kv_fit(n: int, new_tokens: int, kv_len: int, draft: int = 0) -> None:
    """The library's guard (the engine, a batch, speculation): PromptError unless the run's
    kv_positions_used fit `kv_len`. The commands refuse the same runs first (validate_prompt_fit)."""
    used = kv_positions_used(n, new_tokens, draft)
    if n > kv_len:
        raise PromptError(f"prompt of {n} tokens is longer than the KV length {kv_len}; raise --kv-len or shorten the prompt")
    if used > kv_len:
        with_drafts = f" with drafts of {draft} (each verify padded to {draft + 1} rows)" if draft and new_tokens > 1 else ""
        raise PromptError(f"{n} prompt + {new_tokens} new tokens{with_drafts} need {used} KV positions: they exceed "
                          f"the KV length {kv_len}; raise --kv-len or ask for fewer new tokens")


def validate_prompt_fit(prompts, new_tokens: int, source=None, buckets=None, kv_len: int | None = None,
                        max_positions: int | None = None) -> None:
    """The one prompt-fit rule, applied by the commands (harness/cli) and the library
    (harness.parity.observe.check_fit) alike, before any model work: the buckets fit the KV cache, and
    every prompt with its new tokens fits the KV cache (kv_positions_used) and the model's
    positions; a prompt longer than the largest bucket is prefilled in chunks (engine.chunk_plan),
    so `buckets` does not limit its length. Each refusal names the prompt and the option that fixes
    it."""
    where = f"{source or DEFAULT_PROMPTS}: "
    if buckets and kv_len is not None and max(buckets) > kv_len:
        raise PromptError(f"--buckets {','.join(map(str, buckets))}: bucket {max(buckets)} exceeds --kv-len "
                          f"{kv_len}; buckets must fit the KV cache (raise --kv-len or use smaller buckets)")
    longest = max(range(len(prompts)), key=lambda k: len(prompts[k]))
    n = len(prompts[longest])
    used = kv_positions_used(n, new_tokens)
    if kv_len is not None and used > kv_len:
        raise PromptError(f"{where}prompt {longest} has {n} tokens; with --new-tokens {new_tokens} the KV "
                          f"cache needs {used} positions but --kv-len is {kv_len}; raise --kv-len to "
                          f"{used} or use --new-tokens {max(kv_len - n + 1, 0)}")
    if max_positions is not None and n + new_tokens > max_positions:
        raise PromptError(f"{where}prompt {longest} has {n} tokens; with --new-tokens {new_tokens} that is "
                          f"{n + new_tokens} positions, more than the model's max_position_embeddings "
                          f"{max_positions}; use fewer new tokens or a shorter prompt")
