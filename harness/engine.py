"""Host side of the port: embeddings, buckets, prefill, the greedy decode loop, host softcap.

The device (a backend) sees only `inputs_embeds` and absolute positions and returns raw logits.
Word embeddings stay on the host; the softcap is applied here, only where probabilities are asked
for (DESIGN §3, fix 2): greedy decode takes the argmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.errors import PromptError
from harness.model_blocks import per_layer_rows
from harness.numerics import embed_scale, softcap

DEFAULT_KV_LEN = 256  # the published port's KV length
DEFAULT_BUCKETS = (64,)  # the published port's prefill bucket


def choose_bucket(length: int, buckets) -> int:
    """The smallest bucket that holds `length` tokens (a prompt exactly a bucket's size uses it)."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise PromptError(
        f"prompt of {length} tokens is longer than the largest prefill bucket ({max(buckets)}). "
        "Shorten the prompt or add a larger bucket (--buckets), within the KV length."
    )


@dataclass
class PrefillResult:
    # [n, vocab] raw fp32 logits at the real positions; [1, vocab] (the last one only) from a build
    # that returns only what greedy decode needs (a compiled backend's perf build: last_row_only)
    logits: torch.Tensor
    captures: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [n, ...] fp32
    bucket: int = 0


@dataclass
class DecodeResult:
    tokens: list[int]  # the new tokens
    step_logits: torch.Tensor  # [new_tokens, vocab] raw fp32: logits that chose each token
    prefill: PrefillResult | None = None
    # With capture: the capture points of every decode step (steps 1.., the ones the device runs
    # one token at a time), name -> [new_tokens - 1, ...] fp32.
    step_captures: dict[str, torch.Tensor] = field(default_factory=dict)


class Engine:
    """Drives a backend: host embeddings, bucketed prefill, decode with the device KV cache."""

    def __init__(self, spec, backend, embed_weight: torch.Tensor, buckets=DEFAULT_BUCKETS,
                 kv_len: int = DEFAULT_KV_LEN, per_layer_table: torch.Tensor | None = None):
        if max(buckets) > kv_len:
            raise PromptError(f"bucket {max(buckets)} exceeds the KV length {kv_len}; "
                              "buckets must fit in the cache")
        self.spec, self.backend, self.buckets, self.kv_len = spec, backend, tuple(sorted(buckets)), kv_len
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
        """Right-pad to the bucket, run the prefill graph, keep only the real positions (only the last
        one when the backend is a `last_row_only` build and no captures are asked for)."""
        ids = self.validate_ids(ids)
        n = ids.numel()
        bucket = choose_bucket(n, self.buckets)
        padded = torch.cat([ids, torch.full((bucket - n,), self.spec.pad_token_id, dtype=torch.long)])
        positions = torch.arange(bucket)[None]  # padded slots sit after every real key: masked by causality
        self.backend.reset()
        last_only = not capture and getattr(self.backend, "last_row_only", False)
        extra = {"last": n - 1} if last_only else {}
        out = self.backend.forward(self.embed(padded), positions, capture=capture, **extra)
        logits, captures = out if capture else (out, {})
        return PrefillResult(
            logits=logits[0, -1:].float() if last_only else logits[0, :n].float(),
            captures={k: v[0, :n].float() for k, v in captures.items()},
            bucket=bucket,
        )

    def decode_step(self, token: int, position: int, capture: bool = False):
        """Raw logits [vocab] of one decode step; with capture also its capture points (name -> [1, ...])."""
        if position >= self.kv_len:
            raise PromptError(f"position {position} is past the KV length {self.kv_len}; "
                              "ask for fewer new tokens or compile a longer cache")
        out = self.backend.forward(self.embed(torch.tensor([token])), torch.tensor([[position]]), capture=capture)
        if not capture:
            return out[0, -1].float()
        logits, captures = out
        return logits[0, -1].float(), {k: v[0, -1:].float() for k, v in captures.items()}

    def generate(self, ids, new_tokens: int, capture: bool = False,
                 forced: list[int] | None = None, observe=None) -> DecodeResult:
        """Greedy decode: argmax of the raw logits. With `forced`, feed those tokens instead
        (teacher forcing) and still collect the logits at every step. `observe(written)` is called
        after prefill and after each decode step with the number of cache positions written."""
        ids = self.validate_ids(ids)
        if ids.numel() + new_tokens > self.kv_len + 1:
            raise PromptError(f"{ids.numel()} prompt + {new_tokens} new tokens exceed the KV length "
                              f"{self.kv_len}")
        pre = self.prefill(ids, capture=capture)
        if observe is not None:
            observe(ids.numel())
        logits = pre.logits[-1]
        tokens, steps, step_caps = [], [], []
        for step in range(new_tokens):
            steps.append(logits)
            chosen = int(logits.argmax())
            tokens.append(chosen)
            if step == new_tokens - 1:
                break
            fed = forced[step] if forced is not None else chosen
            out = self.decode_step(fed, ids.numel() + step, capture=capture)
            logits = out[0] if capture else out
            if capture:
                step_caps.append(out[1])
            if observe is not None:
                observe(ids.numel() + step + 1)
        step_logits = torch.stack(steps) if steps else torch.empty(0, self.spec.vocab_size)
        stacked = {k: torch.cat([c[k] for c in step_caps]) for k in step_caps[0]} if step_caps else {}
        return DecodeResult(tokens=tokens, step_logits=step_logits, prefill=pre, step_captures=stacked)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Host softcap, then softmax: only here does the cap matter."""
        return torch.softmax(softcap(logits, self.spec.final_logit_softcapping), dim=-1)
