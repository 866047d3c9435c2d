"""Trust nothing in a quality golden that was not verified: its settings file, each shard's
`complete.json` and every part file are read defensively and checked before any model work.

A part is trusted when it loads, holds exactly the columns the reference pass writes with the
shapes and dtypes its window range and top-k imply, every value is finite where it must be
(log-probabilities <= 0, ids inside the vocabulary), and its tokens are the corpus's own windows.
A sealed shard (`complete.json`) must name the corpus, the weights, the spec and the layout of the
golden it sits in (a shard copied from another run is refused, not judged), and every part must
hash to what it recorded. Each refusal is a GoldenError (exit 2) naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from harness.base.errors import GoldenError

MAX_OWN_JSON_BYTES = 64 << 20
# the settings an existing golden fixes, with the least each may be
SETTING_MINIMUM = {"window": 2, "topk": 1, "windows_per_part": 1, "shards": 1, "corpus_ids": 0}
# shard identity: what complete.json must share with quality-golden.json
IDENTITY = ("corpus_sha256", "spec_hash", "weights", "window", "topk", "windows_per_part", "shards")


def read_own_json(file: Path, fix: str) -> dict:
    """A JSON object this tool wrote; anything else (a list, deep nesting, huge numbers, binary) is a
    GoldenError naming the file and `fix`."""
    try:
        if not file.is_file():
            raise GoldenError(f"{file}: not a regular file; {fix}")
        if file.stat().st_size > MAX_OWN_JSON_BYTES:
            raise GoldenError(f"{file}: {file.stat().st_size} bytes, not a file gemma-parity wrote; {fix}")
        data = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise GoldenError(f"{file}: unreadable ({reason}); {fix}") from None
    if not isinstance(data, dict):
        raise GoldenError(f"{file}: holds a JSON {type(data).__name__}, not the object gemma-parity writes; {fix}")
    return data


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_settings(found: dict, file: Path) -> dict:
    """The settings of an existing golden, each an integer of the right range where present."""
    fix = f"remove {file.parent} (or give a new --golden directory) and rerun"
    for name, low in SETTING_MINIMUM.items():
        if name in found and (not _is_int(found[name]) or found[name] < low or found[name] > 2 ** 40):
            raise GoldenError(f"{file}: {name} is {str(found[name])[:40]!r}, not an integer >= {low}; {fix}")
    if "topk" in found and found["topk"] > 256:
        raise GoldenError(f"{file}: topk {found['topk']} is over 256; {fix}")
    return found


def check_identity(complete: dict, settings_json: dict, file: Path, shard: int) -> None:
    differ = [k for k in IDENTITY if complete.get(k) != settings_json.get(k)]
    if complete.get("shard") != shard:
        differ.insert(0, "shard")
    if differ:
        raise GoldenError(f"{file}: shard {shard} was written for another run ({', '.join(differ)} differ from "
                          f"{file.parent.parent}'s quality-golden.json); delete {file.parent} and rerun "
                          f"`gemma-parity quality --shard {shard}/{settings_json.get('shards')}` for it")
    parts = complete.get("parts")
    if not isinstance(parts, dict) or not all(isinstance(v, str) for v in parts.values()):
        raise GoldenError(f"{file}: its parts are not a name -> sha256 table; delete {file.parent} and rerun its "
                          "reference pass")


def expected_columns(n: int, window: int, k: int) -> dict[str, tuple[torch.dtype, tuple]]:
    """What the reference pass writes for a part of n windows (see quality._part_tensors)."""
    rows = (n, window - 1)
    cols = {"topk_ids": (torch.int32, (*rows, k)), "topk_logprobs": (torch.float32, (*rows, k)),
            "tokens": (torch.int32, (n, window)), "bf16_top1": (torch.int8, rows)}
    for name in ("tail_logprob", "lse", "target_logprob", "bf16_kl", "bf16_dp", "bf16_nll"):
        cols[name] = (torch.float32, rows)
    return cols


def _column_problem(name: str, t: torch.Tensor, vocab: int) -> str | None:
    if name in ("topk_ids", "tokens"):
        bad = (t < 0) | (t >= vocab)
        return f"{name} holds ids outside the vocabulary [0, {vocab})" if bool(bad.any()) else None
    if t.dtype == torch.int8:
        return f"{name} holds values other than 0 and 1" if bool(((t != 0) & (t != 1)).any()) else None
    if bool(torch.isnan(t).any()) or bool(torch.isposinf(t).any()):
        return f"{name} holds NaN or +inf"
    if name == "tail_logprob":  # -inf only when the top-k is the whole vocabulary
        return f"{name} is above 0" if bool((t > 1e-4).any()) else None
    if bool(torch.isneginf(t).any()):
        return f"{name} holds -inf"
    if name in ("topk_logprobs", "target_logprob") and bool((t > 1e-4).any()):
        return f"{name} holds a log-probability above 0"
    return None


def verify_part(file: Path, part: range, settings, vocab: int, corpus: torch.Tensor | None) -> dict:
    """Load one part and check it whole (see the module's docstring); returns its tensors."""
    from safetensors import safe_open

    fix = f"delete {file} and rerun the reference pass (`gemma-parity quality ... --golden ...` resumes there)"
    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001  (safetensors raises its own error types for damaged files)
        raise GoldenError(f"{file}: not a readable part file ({type(exc).__name__}: {str(exc)[:120]}); {fix}") from None
    want = expected_columns(len(part), settings.window, min(settings.topk, vocab))
    if set(tensors) != set(want):
        odd = sorted(set(want) ^ set(tensors))
        raise GoldenError(f"{file}: columns {', '.join(odd[:4])} missing or unexpected; {fix}")
    for name, (dtype, shape) in want.items():
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise GoldenError(f"{file}: {name} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)} "
                              f"(windows {part.start}-{part.stop - 1}, top-k {settings.topk}); {fix}")
        problem = _column_problem(name, t, vocab)
        if problem:
            raise GoldenError(f"{file}: {problem}; {fix}")
    if meta.get("windows") != f"{part.start}-{part.stop}":
        raise GoldenError(f"{file}: records windows {meta.get('windows')!r}, not {part.start}-{part.stop}; {fix}")
    if corpus is not None and not torch.equal(tensors["tokens"].long(), corpus):
        raise GoldenError(f"{file}: its tokens are not the corpus's windows {part.start}-{part.stop - 1} (a part "
                          f"of another corpus or copied over another part); {fix}")
    return tensors


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
