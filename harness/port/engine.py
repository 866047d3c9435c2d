"""Host side of the port: embeddings, buckets, and the device calls: prefill, a decode step, a
verify call, each of rows in KV slots; the host softcap. (The decode loop over these is
harness/port/decode.py.)

The device (a backend) sees only `inputs_embeds`, absolute positions and, on a build of several KV
slots, the slot of each row (`seq_ids`, as NxD Inference passes them); it returns raw logits. Word
embeddings stay on the host; the softcap is applied here, only where probabilities are asked for
(docs/design.md#the-port): greedy decode takes the argmax of the raw logits.

One engine serves batch 1 and a batch alike: a call takes rows, positions and KV slots; batch 1 is
one slot. Which graphs run is decided in `call` alone: a one-slot build its batch-1 graphs (no
`seq_ids`; a perf build told its last real row), else the smallest batch bucket
(graphs.batch_buckets) holding the rows, filled with rows of padding in slots no real row names
(they write nothing). Each row is masked by its own positions only (tests/parity/test_batch_isolation.py:
bit for bit), so a slot a finished sequence leaves takes a new prompt with no reset.
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
from harness.port.graphs import batch_buckets
from harness.port.kv_slots import check_seq_ids
from harness.port.rank_merge import merge_rank_caches
from harness.port.sharding import ring_windows


def choose_bucket(length: int, buckets) -> int:
    """The smallest bucket that holds `length` tokens (a prompt exactly a bucket's size uses it)."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise PromptError(
        f"prompt of {length} tokens is longer than the largest prefill bucket ({max(buckets)}). "
        "Shorten the prompt or add a larger bucket (--buckets), within the KV length."
    )


def chunk_bucket(starts: list[int], rests: list[int], buckets, kv_len: int) -> int:
    """The sequence bucket of one prefill call whose rows start at `starts` with `rests` tokens left:
    the smallest bucket holding every row's rest, else the largest; every row's padded chunk stays
    inside the linear cache (start + bucket <= kv_len), down to the decode graph (bucket 1)."""
    active = [(s, r) for s, r in zip(starts, rests) if r > 0]
    fits = [b for b in sorted(buckets) if all(s + b <= kv_len for s, _ in active)]
    holding = [b for b in fits if b >= max(r for _, r in active)]
    return min(holding) if holding else max(fits, default=1)


def chunk_plan(n: int, buckets, kv_len: int) -> list[tuple[int, int, int]]:
    """(start, length, bucket) of each prefill chunk of an n-token prompt alone (chunk_bucket for
    one row): the largest bucket while the rest is longer, then the smallest that holds the rest."""
    check_kv_fit(n, 0, kv_len)
    plan, start = [], 0
    while start < n:
        bucket = chunk_bucket([start], [n - start], buckets, kv_len)
        plan.append((start, min(n - start, bucket), bucket))
        start += min(n - start, bucket)
    return plan


def chunk_positions(start: int, length: int, bucket: int) -> torch.Tensor:
    """[1, bucket] positions of a chunk: its real rows at start.., its padded rows at -1 (a row with
    nothing left in this call: every position -1)."""
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
    """Drives a backend: host embeddings, bucketed prefill, decode and verify calls of rows in the
    device KV cache's slots (settings.batch; batch 1 is one slot)."""

    def __init__(self, spec, backend, embed_weight: torch.Tensor, settings: RunSettings = RunSettings(),
                 per_layer_table: torch.Tensor | None = None):
        """`backend` built from `settings` (harness.backends.build_engine builds both)."""
        if max(settings.buckets) > settings.kv_len:
            raise PromptError(f"bucket {max(settings.buckets)} exceeds the KV length {settings.kv_len}; "
                              "buckets must fit in the cache")
        if settings.batch > 1 and not backend.serves_batch:
            raise HarnessInputError(f"the {backend.name} backend does not serve batches (no seq_ids)")
        self.spec, self.backend, self.settings = spec, backend, settings
        self.buckets, self.kv_len = settings.buckets, settings.kv_len
        self.slots, self.batch_sizes = settings.batch, batch_buckets(settings.batch)
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

    # -- device calls: rows, positions, KV slots --------------------------------------------------
    def call(self, chunks: list, positions: list, seq_ids, capture: bool, verify: bool = False):
        """One device call: row r is chunk ids (right-padded here to the call's length) at positions
        [s] (-1 padded) in KV slot seq_ids[r]; `verify`: the verify graph. -> (raw fp32 logits
        [rows, s, vocab], captures [rows, s, ...]); a last-row-only perf build returns each row's
        last real position only: logits [rows, 1, vocab]."""
        rows, length = len(chunks), positions[0].numel()
        seq = check_seq_ids(seq_ids, rows, self.slots).tolist()
        size = self.batch_bucket(rows)
        pad = self.spec.pad_token_id
        padded = [torch.cat([c, torch.full((length - c.numel(),), pad, dtype=torch.long)]) for c in chunks]
        if self.slots == 1:  # the build's batch-1 graphs: no slots named, a perf build told its last real row
            last = int((positions[0] >= 0).sum()) - 1 if self.backend.last_row_only and not verify else None
            logits, caps = self.backend.forward(self.embed(padded[0]), positions[0][None], capture=capture,
                                                last=last, verify=verify)
        else:
            fillers = [s for s in range(self.slots) if s not in seq][:size - rows]
            embeds = torch.cat([self.embed(c) for c in [*padded, *[padded[0] * 0 + pad] * len(fillers)]])
            pos = torch.stack([*positions, *[torch.full((length,), -1)] * len(fillers)])
            logits, caps = self.backend.forward(embeds, pos, capture=capture, seq_ids=torch.tensor(seq + fillers),
                                                verify=verify)
        return logits[:rows].float(), {k: v[:rows].float() for k, v in caps.items()}

    def batch_bucket(self, rows: int) -> int:
        for size in self.batch_sizes:
            if rows <= size:
                return size
        raise PromptError(f"{rows} sequences in one call: the cache has {self.slots} slots (--batch {self.slots})")

    def prefill_rows(self, prompts: list, seq_ids, capture: bool = False) -> list[PrefillResult]:
        """Prefill each prompt into its slot (seq_ids), ragged prompts in the same calls: per call each
        row with tokens left takes its next chunk (chunk_bucket), right-padded to the call's bucket,
        its padded rows at position -1 (they attend to nothing and write nothing a later query
        reads); a row with nothing left is padding. The other slots keep their state; a one-slot
        cache starts afresh (backend.reset). Keeps only the real positions (only the last one when
        the backend is a `last_row_only` build and no captures are asked for)."""
        ids = [self.validate_ids(p) for p in prompts]
        self.check_capture(capture)
        for p in ids:
            check_kv_fit(p.numel(), 0, self.kv_len)
        if self.slots == 1:
            self.backend.reset()
        last_only = not capture and self.backend.last_row_only
        starts, logits, caps, bucket = [0] * len(ids), [[] for _ in ids], [{} for _ in ids], 0
        while any(s < p.numel() for s, p in zip(starts, ids)):
            rests = [p.numel() - s for s, p in zip(starts, ids)]
            bucket = chunk_bucket(starts, rests, self.buckets, self.kv_len)
            takes = [min(r, bucket) for r in rests]
            out, out_caps = self.call([p[s:s + t] for p, s, t in zip(ids, starts, takes)],
                                      [chunk_positions(s, t, bucket)[0] for s, t in zip(starts, takes)], seq_ids, capture)
            for r, t in enumerate(takes):
                if t:
                    logits[r].append(out[r, -1:] if last_only else out[r, :t])
                    for name, value in out_caps.items():
                        caps[r].setdefault(name, []).append(value[r, :t])
            starts = [s + t for s, t in zip(starts, takes)]
        return [PrefillResult(logits=lg[-1] if last_only else torch.cat(lg),
                              captures={k: torch.cat(v) for k, v in c.items()}, bucket=bucket)
                for lg, c in zip(logits, caps)]

    def decode_rows(self, tokens: list[int], positions: list[int], seq_ids, capture: bool = False) -> list[Step]:
        """One decode step of several sequences, each at its own position in its own slot."""
        self.check_capture(capture)
        for p in positions:
            if p >= self.kv_len:
                raise PromptError(f"position {p} is past the KV length {self.kv_len}; "
                                  "ask for fewer new tokens or compile a longer cache")
        out, caps = self.call([torch.tensor([t]) for t in tokens], [torch.tensor([p]) for p in positions], seq_ids,
                              capture)
        return [Step(out[r, -1], {k: v[r, -1:] for k, v in caps.items()}) for r in range(len(tokens))]

    def verify_rows(self, rows: list, positions: list[int], seq_ids, capture: bool = False) -> list[Step]:
        """Speculative decoding's verify call (harness/port/speculate.py) of several sequences: row r,
        n <= k+1 tokens, at positions[r].. in slot seq_ids[r], a prefill chunk at the current position
        against the cache. With settings.speculate = k every row is padded to k+1 (padded rows at
        position -1), so every verify runs the build's one verify graph (graphs.VERIFY_TAG); k = 0
        pads to the longest row (the cpu backend takes any length). Writes the n KV entries (the
        padded rows' slots after them are overwritten before any query reads them); returns per
        sequence n rows of raw fp32 logits [n, vocab] and captures name -> [n, ...]: every capture
        point on a parity build, always "final_norm" (a perf build's verify graph returns it).
        Rollback needs no call: masks go by position, so rejected entries are never read and the
        next verify at the same positions overwrites them."""
        ids = [self.validate_ids(r) for r in rows]
        k = self.settings.speculate
        width = k + 1 if k else max(r.numel() for r in ids)
        for r, p in zip(ids, positions):
            if k and r.numel() > k + 1:
                raise PromptError(f"verify of {r.numel()} tokens: this build verifies k+1 = {k + 1} at most (--speculate {k})")
            if p + width > self.kv_len:
                raise PromptError(f"verify of {width} rows at position {p} is past the KV length {self.kv_len}; "
                                  "ask for fewer new tokens or compile a longer cache")
        self.check_capture(capture)
        pos = [chunk_positions(p, r.numel(), width)[0] for r, p in zip(ids, positions)]
        out, caps = self.call(ids, pos, seq_ids, capture or self.backend.returns_captures, verify=True)
        return [Step(out[i, :r.numel()], {name: v[i, :r.numel()] for name, v in caps.items()}) for i, r in enumerate(ids)]

    # one sequence in slot 0: the calls above with one row
    def prefill(self, ids, capture: bool = False) -> PrefillResult:
        return self.prefill_rows([ids], [0], capture)[0]

    def decode_step(self, token: int, position: int, capture: bool = False) -> Step:
        return self.decode_rows([token], [position], [0], capture)[0]

    def verify(self, tokens, position: int, capture: bool = False) -> Step:
        return self.verify_rows([tokens], [position], [0], capture)[0]

    def start(self) -> None:
        """A run over several slots starts from a reset cache (one slot resets at each prefill)."""
        if self.slots > 1:
            self.backend.reset()

    def check_capture(self, capture: bool) -> None:
        if capture and not self.backend.returns_captures:
            raise HarnessInputError(f"the {self.backend.name} backend was built without captures (a perf "
                                    "build); build it with capture=True for a parity run")

    def read_cache(self, written: int, slot: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's KV cache of the sequence in `slot` at the positions it holds after `written`
        writes, as the port stores it (keys after norm and rope, values after v_norm), merged over
        ranks, oldest position first: per layer (k, v), [kv_heads, held, d] ([0, written) of a
        linear cache, the last window positions of a ring, unrolled)."""
        if not self.backend.reads_cache:
            raise HarnessInputError(f"the {self.backend.name} backend cannot read its KV cache back")
        rings = ring_windows(self.spec, self.settings.sliding_cache, self.kv_len)
        one = lambda layer, rank: tuple(t[slot:slot + 1] for t in self.backend.kv_cache(layer, rank))  # noqa: E731
        return merge_rank_caches(self.spec, self.backend.tp, one, written, rings)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Host softcap, then softmax: only here does the cap matter."""
        return torch.softmax(softcap(logits, self.spec.final_logit_softcapping), dim=-1)
