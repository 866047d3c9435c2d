"""Host side of serving a batch: ragged prompts in one call, a KV slot per sequence (NxD
Inference's conventions: `seq_ids` name the slots a call works on, batch buckets). The decode loop
over these calls, continuous batching included, is harness/port/decode.py.

A `BatchEngine` drives the same backend and host embeddings as `Engine`, built with
`settings.batch` KV slots. Every call is padded twice: each row's chunk to the call's sequence
bucket (padded positions -1, as batch 1), and the rows to the smallest batch bucket
(graphs.batch_buckets) with filler rows (all positions -1, a slot no real row of the call names:
they write nothing). Each row is masked by its own positions only, so a row's results never
depend on its companions (tests/parity/test_batch_isolation.py proves it bit for bit), and a slot
a finished sequence leaves takes a new prompt with no reset: its old keys sit past the new
sequence's positions or are overwritten before they are read.
"""

from __future__ import annotations

import torch

from harness.base.errors import HarnessInputError, PromptError
from harness.inputs.prompts import check_kv_fit
from harness.port.engine import Engine, PrefillResult, Step, chunk_positions
from harness.port.graphs import batch_buckets
from harness.port.kv_slots import check_seq_ids
from harness.port.sharding import merge_rank_caches, ring_windows


def batch_chunk(starts: list[int], rests: list[int], buckets, kv_len: int) -> int:
    """The sequence bucket of one batched prefill call (engine.chunk_plan for several rows): the
    smallest bucket holding every row's rest, else the largest; every row's padded chunk stays
    inside the cache (start + bucket <= kv_len), down to the decode graph (1)."""
    active = [(s, r) for s, r in zip(starts, rests) if r > 0]
    fits = [b for b in sorted(buckets) if all(s + b <= kv_len for s, _ in active)]
    holding = [b for b in fits if b >= max(r for _, r in active)]
    return min(holding) if holding else max(fits, default=1)


class BatchEngine:
    """Prefill and decode of several sequences per call, each in its own KV slot."""

    def __init__(self, engine: Engine):
        if not engine.backend.serves_batch:
            raise HarnessInputError(f"the {engine.backend.name} backend does not serve batches (no seq_ids)")
        self.engine, self.backend = engine, engine.backend
        self.slots = engine.settings.batch
        self.batch_sizes = batch_buckets(self.slots)

    def batch_bucket(self, rows: int) -> int:
        for size in self.batch_sizes:
            if rows <= size:
                return size
        raise PromptError(f"{rows} sequences in one call: the cache has {self.slots} slots (--batch {self.slots})")

    def forward(self, chunks: list[torch.Tensor], positions: list[torch.Tensor], seq_ids, capture: bool,
                verify: bool = False):
        """One device call: row r is chunk ids [s] at positions [s] (-1 padded) in slot seq_ids[r];
        the rows are padded to the batch bucket (`verify`: the verify graph). -> (logits [rows, s, vocab],
        captures [rows, s, ...]); a last-row-only perf build returns each row's last real position only:
        logits [rows, 1, vocab]."""
        rows, length = len(chunks), positions[0].numel()
        seq = check_seq_ids(seq_ids, rows, self.slots).tolist()
        size = self.batch_bucket(rows)
        fillers = [s for s in range(self.slots) if s not in seq][:size - rows]
        pad = self.engine.spec.pad_token_id
        padded = [torch.cat([c, torch.full((length - c.numel(),), pad, dtype=torch.long)]) for c in chunks]
        embeds = torch.cat([self.engine.embed(c) for c in [*padded, *[padded[0] * 0 + pad] * len(fillers)]])
        pos = torch.stack([*positions, *[torch.full((length,), -1)] * len(fillers)])
        logits, caps = self.backend.forward(embeds, pos, capture=capture, seq_ids=torch.tensor(seq + fillers), verify=verify)
        return logits[:rows].float(), {k: v[:rows].float() for k, v in caps.items()}

    def prefill(self, prompts: list, seq_ids, capture: bool = False) -> list[PrefillResult]:
        """Prefill each prompt into its slot (seq_ids), ragged prompts in the same calls: per call
        each row with tokens left takes its next chunk, the others are padding. The other slots
        keep their state. On a last-row-only perf build each result holds the prompt's last
        position's logits only (as Engine.prefill's)."""
        ids = [self.engine.validate_ids(p) for p in prompts]
        self.engine.check_capture(capture)
        for p in ids:
            check_kv_fit(p.numel(), 0, self.engine.kv_len)
        starts, logits, caps, bucket = [0] * len(ids), [[] for _ in ids], [{} for _ in ids], 0
        while any(s < p.numel() for s, p in zip(starts, ids)):
            rests = [p.numel() - s for s, p in zip(starts, ids)]
            bucket = batch_chunk(starts, rests, self.engine.buckets, self.engine.kv_len)
            takes = [min(r, bucket) for r in rests]
            chunks = [p[s:s + t] for p, s, t in zip(ids, starts, takes)]
            pos = [torch.cat([torch.arange(s, s + t), torch.full((bucket - t,), -1)]) if t else torch.full((bucket,), -1)
                   for s, t in zip(starts, takes)]
            out, out_caps = self.forward(chunks, pos, seq_ids, capture)
            for r, t in enumerate(takes):
                if t:
                    logits[r].append(out[r, :t])
                    for name, value in out_caps.items():
                        caps[r].setdefault(name, []).append(value[r, :t])
            starts = [s + t for s, t in zip(starts, takes)]
        last_only = self.backend.last_row_only
        return [PrefillResult(logits=lg[-1][-1:] if last_only else torch.cat(lg), captures={k: torch.cat(v) for k, v in c.items()}, bucket=bucket)
                for lg, c in zip(logits, caps)]

    def decode(self, tokens: list[int], positions: list[int], seq_ids, capture: bool = False) -> list[Step]:
        """One decode step of several sequences, each at its own position in its own slot."""
        self.engine.check_capture(capture)
        for p in positions:
            if p >= self.engine.kv_len:
                raise PromptError(f"position {p} is past the KV length {self.engine.kv_len}; ask for fewer new tokens")
        chunks = [torch.tensor([t]) for t in tokens]
        out, caps = self.forward(chunks, [torch.tensor([p]) for p in positions], seq_ids, capture)
        return [Step(out[r, -1], {k: v[r, -1:] for k, v in caps.items()}) for r in range(len(tokens))]

    def verify(self, rows: list, positions: list[int], seq_ids, capture: bool = False) -> list[Step]:
        """Engine.verify of several sequences in one call: row r's tokens at positions[r].. in slot
        seq_ids[r], every row padded to k+1 (settings.speculate; the longest row when 0). Each
        sequence's [n, vocab] logits and captures (always "final_norm", as Engine.verify)."""
        ids = [self.engine.validate_ids(r) for r in rows]
        k = self.engine.settings.speculate
        width = k + 1 if k else max(r.numel() for r in ids)
        for r, p in zip(ids, positions):
            if k and r.numel() > k + 1:
                raise PromptError(f"verify of {r.numel()} tokens: this build verifies k+1 = {k + 1} at most (--speculate {k})")
            if p + width > self.engine.kv_len:
                raise PromptError(f"verify of {width} rows at position {p} is past the KV length {self.engine.kv_len}; "
                                  "ask for fewer new tokens or compile a longer cache")
        self.engine.check_capture(capture)
        pos = [chunk_positions(p, r.numel(), width)[0] for r, p in zip(ids, positions)]
        out, caps = self.forward(ids, pos, seq_ids, capture or self.backend.returns_captures, verify=True)
        return [Step(out[i, :r.numel()], {name: v[i, :r.numel()] for name, v in caps.items()}) for i, r in enumerate(ids)]

    def read_cache(self, slot: int, written: int) -> list:
        """Engine.read_cache of one slot: every layer's (k, v) of the sequence in `slot`."""
        rings = ring_windows(self.engine.spec, self.engine.settings.sliding_cache, self.engine.kv_len)
        one = lambda layer, rank: tuple(t[slot:slot + 1] for t in self.backend.kv_cache(layer, rank))  # noqa: E731
        return merge_rank_caches(self.engine.spec, self.backend.tp, one, written, rings)
