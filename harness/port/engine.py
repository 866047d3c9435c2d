"""Host side of the port: embeddings, buckets, prefill, one decode step, one verify call, host softcap.
(The decode loop over these is harness/port/decode.py.)

The device (a backend) sees only `inputs_embeds` and absolute positions and returns raw logits.
Word embeddings stay on the host; the softcap is applied here, only where probabilities are asked
for (docs/design.md#the-port): greedy decode takes the argmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from harness.base.errors import HarnessInputError, PromptError
from harness.base.numerics import embed_scale, softcap
from harness.base.settings import RunSettings
from harness.inputs.prompts import check_kv_fit
from harness.port.blocks import per_layer_rows
from harness.port.sharding import merge_rank_caches, ring_windows


def choose_bucket(length: int, buckets) -> int:
    """The smallest bucket that holds `length` tokens (a prompt exactly a bucket's size uses it)."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise PromptError(
        f"prompt of {length} tokens is longer than the largest prefill bucket ({max(buckets)}). "
        "Shorten the prompt or add a larger bucket (--buckets), within the KV length."
    )


def chunk_plan(n: int, buckets, kv_len: int) -> list[tuple[int, int, int]]:
    """(start, length, bucket) of each prefill chunk of an n-token prompt: the largest bucket while
    the rest is longer, then the smallest bucket that holds the rest. A chunk's padded slots must
    stay inside the linear cache (start + bucket <= kv_len): where no bucket fits there, the tail
    goes through the largest bucket that does, down to the decode graph (bucket 1)."""
    check_kv_fit(n, 0, kv_len)
    plan, start = [], 0
    while start < n:
        rest, fits = n - start, [b for b in sorted(buckets) if start + b <= kv_len]
        holding = [b for b in fits if b >= rest]
        bucket = min(holding) if holding else max(fits, default=1)
        plan.append((start, min(rest, bucket), bucket))
        start += min(rest, bucket)
    return plan


def chunk_positions(start: int, length: int, bucket: int) -> torch.Tensor:
    """[1, bucket] positions of a chunk: its real rows at start.., its padded rows at -1."""
    return torch.cat([torch.arange(start, start + length), torch.full((bucket - length,), -1)])[None]


@dataclass
class PrefillResult:
    # [n, vocab] raw fp32 logits at the real positions; [1, vocab] (the last one only) from a build
    # that returns only what greedy decode needs (a compiled backend's perf build: last_row_only)
    logits: torch.Tensor
    captures: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [n, ...] fp32
    bucket: int = 0


class Step(NamedTuple):
    """One decode step: raw fp32 logits [vocab] and its capture points (name -> [1, ...]; empty
    unless asked for)."""

    logits: torch.Tensor
    captures: dict[str, torch.Tensor]


@dataclass
class DecodeResult:
    """One sequence decoded by harness.port.decode.generate (greedy, forced or speculative)."""

    tokens: list[int]  # the new tokens
    step_logits: torch.Tensor  # [new_tokens, vocab] raw fp32: logits that chose each token
    prefill: PrefillResult | None = None
    # With capture: the capture points of every decode step (steps 1.., the ones the device runs
    # one token at a time), name -> [new_tokens - 1, ...] fp32.
    step_captures: dict[str, torch.Tensor] = field(default_factory=dict)
    # speculative decoding (harness/port/speculate.py): per verify call its accepted drafts, per
    # round its drafts; with capture, per draft step its captures and inputs (position, token,
    # state fed, round), per round the target's cache the drafter read (read_cache(position))
    accepted: list[int] = field(default_factory=list)
    drafted: list[list[int]] = field(default_factory=list)
    draft_captures: list[dict] = field(default_factory=list)
    draft_inputs: list[dict] = field(default_factory=list)
    round_caches: list = field(default_factory=list)
    steps: list = field(default_factory=list, repr=False)  # the rows of step_logits while decoding
    step_caps: list = field(default_factory=list, repr=False)  # the step captures while decoding

    @property
    def verifies(self) -> int:
        return len(self.accepted)

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens per verify call (0..k)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


class Engine:
    """Drives a backend: host embeddings, bucketed prefill, decode with the device KV cache."""

    def __init__(self, spec, backend, embed_weight: torch.Tensor, settings: RunSettings = RunSettings(),
                 per_layer_table: torch.Tensor | None = None):
        """`backend` built from `settings` (harness.backends.build_engine builds both)."""
        if max(settings.buckets) > settings.kv_len:
            raise PromptError(f"bucket {max(settings.buckets)} exceeds the KV length {settings.kv_len}; "
                              "buckets must fit in the cache")
        self.spec, self.backend, self.settings = spec, backend, settings
        self.buckets, self.kv_len = settings.buckets, settings.kv_len
        self.embed_weight = embed_weight
        self.scale = embed_scale(spec.hidden_size, embed_weight.dtype)
        self.placeholders = torch.tensor(spec.placeholder_token_ids or [-1])
        # E2B/E4B: the packed per-layer table, host-side like the word embeddings (vocabulary-sized)
        self.per_layer_table = per_layer_table
        if spec.per_layer_input_size and per_layer_table is None:
            raise ValueError("this model has per-layer input embeddings: pass per_layer_table")

    # -- host embeddings ---------------------------------------------------------------------
    def validate_ids(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise PromptError("empty prompt: give at least one token id")
        bad = ((ids < 0) | (ids >= self.spec.vocab_size)) & ~torch.isin(ids, self.placeholders)
        if bad.any():
            first = int(ids[bad][0])
            raise PromptError(
                f"token id {first} at position {int(bad.nonzero()[0])} is outside the vocabulary "
                f"[0, {self.spec.vocab_size}); check the prompt file or the tokenizer it came from"
            )
        return ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] ids -> [1, n, hidden]; multimodal placeholder ids become pad, as the wrapper does."""
        ids = torch.where(torch.isin(ids, self.placeholders), self.spec.pad_token_id, ids)
        embeds = (self.embed_weight[ids] * self.scale)[None]
        if self.per_layer_table is None:
            return embeds
        # Each token's row of the per-layer table, scaled by sqrt(per_layer_input) in the table's
        # dtype (transformers' scaled embedding), appended: the device's input is [1, n, hidden + L*P].
        rows = per_layer_rows(self.per_layer_table, ids, self.spec.per_layer_input_size)
        return torch.cat([embeds, rows.to(embeds.dtype)[None]], dim=-1)

    # -- device steps ----------------------------------------------------------------------------
    def prefill(self, ids, capture: bool = False) -> PrefillResult:
        """Prefill chunk by chunk (chunk_plan): each chunk right-padded to its bucket, its real rows
        at their absolute positions and its padded rows at position -1 (they attend to nothing and
        write nothing a later query reads). Keeps only the real positions (only the last one when
        the backend is a `last_row_only` build and no captures are asked for)."""
        ids = self.validate_ids(ids)
        n = ids.numel()
        self.check_capture(capture)
        self.backend.reset()
        last_only = not capture and self.backend.last_row_only
        logits, captures, bucket = [], {}, 0
        for start, length, bucket in chunk_plan(n, self.buckets, self.kv_len):
            pad = bucket - length
            chunk = torch.cat([ids[start:start + length], torch.full((pad,), self.spec.pad_token_id, dtype=torch.long)])
            chunk_logits, chunk_caps = self.backend.forward(self.embed(chunk), chunk_positions(start, length, bucket),
                                                            capture=capture, last=length - 1 if last_only else None)
            logits.append(chunk_logits[0, -1:].float() if last_only else chunk_logits[0, :length].float())
            for name, value in chunk_caps.items():
                captures.setdefault(name, []).append(value[0, :length].float())
        return PrefillResult(
            logits=logits[-1] if last_only else torch.cat(logits),
            captures={k: torch.cat(v) for k, v in captures.items()},
            bucket=bucket,
        )

    def decode_step(self, token: int, position: int, capture: bool = False) -> Step:
        """One decode step: raw logits [vocab] and (with capture) its capture points."""
        if position >= self.kv_len:
            raise PromptError(f"position {position} is past the KV length {self.kv_len}; "
                              "ask for fewer new tokens or compile a longer cache")
        self.check_capture(capture)
        logits, captures = self.backend.forward(self.embed(torch.tensor([token])), torch.tensor([[position]]),
                                                capture=capture)
        return Step(logits[0, -1].float(), {k: v[0, -1:].float() for k, v in captures.items()})

    def verify(self, tokens, position: int, capture: bool = False) -> Step:
        """Speculative decoding's verify call (harness/port/speculate.py): the target on n <= k+1 tokens
        at positions position.. in one call, a prefill chunk at the current position against the
        cache. With settings.speculate = k the call is padded to k+1 rows (padded rows at position
        -1, as prefill chunks pad), so every verify runs the build's one verify graph
        (graphs.VERIFY_TAG); k = 0 runs the n rows as they are (the cpu backend takes any length).
        Writes the n KV entries (the padded rows' slots after them are overwritten before any query
        reads them); returns n rows of raw fp32 logits [n, vocab] and captures name -> [n, ...]:
        every capture point on a parity build, always "final_norm" (a perf build's verify graph
        returns it). Rollback needs no call: the cache is linear by absolute position and masks go
        by position, so the entries of rejected tokens are never read (a later query sits before
        them) and the next verify at the same positions overwrites them."""
        ids = self.validate_ids(tokens)
        n, k = ids.numel(), self.settings.speculate
        if k and n > k + 1:
            raise PromptError(f"verify of {n} tokens: this build verifies k+1 = {k + 1} at most (--speculate {k})")
        rows = k + 1 if k else n
        if position + rows > self.kv_len:
            raise PromptError(f"verify of {rows} rows at position {position} is past the KV length {self.kv_len}; "
                              "ask for fewer new tokens or compile a longer cache")
        self.check_capture(capture)
        padded = torch.cat([ids, torch.full((rows - n,), self.spec.pad_token_id, dtype=torch.long)])
        logits, captures = self.backend.forward(self.embed(padded), chunk_positions(position, n, rows),
                                                capture=capture or self.backend.returns_captures, verify=True)
        return Step(logits[0, :n].float(), {k: v[0, :n].float() for k, v in captures.items()})

    def check_capture(self, capture: bool) -> None:
        if capture and not self.backend.returns_captures:
            raise HarnessInputError(f"the {self.backend.name} backend was built without captures (a perf "
                                    "build); build it with capture=True for a parity run")

    def read_cache(self, written: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's KV cache at the positions it holds after `written` writes, as the port
        stores it (keys after norm and rope, values after v_norm), merged over ranks, oldest position
        first: per layer (k, v), [kv_heads, held, d] ([0, written) of a linear cache, the last window
        positions of a ring, unrolled)."""
        if not self.backend.reads_cache:
            raise HarnessInputError(f"the {self.backend.name} backend cannot read its KV cache back")
        rings = ring_windows(self.spec, self.settings.sliding_cache, self.kv_len)
        return merge_rank_caches(self.spec, self.backend.tp, self.backend.kv_cache, written, rings)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Host softcap, then softmax: only here does the cap matter."""
        return torch.softmax(softcap(logits, self.spec.final_logit_softcapping), dim=-1)
