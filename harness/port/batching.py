"""Host side of serving a batch: ragged prompts in one call, a KV slot per sequence, continuous
batching (NxD Inference's conventions: `seq_ids` name the slots a call works on, batch buckets).

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

from dataclasses import dataclass, field

import torch

from harness.base.errors import HarnessInputError, PromptError
from harness.inputs.prompts import check_kv_fit
from harness.port.engine import DecodeResult, Engine, PrefillResult, Step
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


@dataclass
class _Sequence:
    """A sequence being served: its prompt, slot, and what it has produced so far."""

    index: int
    ids: torch.Tensor
    slot: int
    logits: torch.Tensor  # the raw logits choosing its next token
    prefill: PrefillResult
    tokens: list[int] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # the tokens fed to decode (forced or chosen)
    step_caps: list[dict] = field(default_factory=list)


class BatchEngine:
    """Prefill and decode of several sequences per call, each in its own KV slot."""

    def __init__(self, engine: Engine):
        if not engine.backend.serves_batch:
            raise HarnessInputError(f"the {engine.backend.name} backend does not serve batches (no seq_ids)")
        if engine.backend.last_row_only:
            raise HarnessInputError(f"the {engine.backend.name} backend is a last-row-only perf build; batched "
                                    "serving here needs every row's logits (build it with capture=True)")
        self.engine, self.backend = engine, engine.backend
        self.slots = engine.settings.batch
        self.batch_sizes = batch_buckets(self.slots)

    def batch_bucket(self, rows: int) -> int:
        for size in self.batch_sizes:
            if rows <= size:
                return size
        raise PromptError(f"{rows} sequences in one call: the cache has {self.slots} slots (--batch {self.slots})")

    def forward(self, chunks: list[torch.Tensor], positions: list[torch.Tensor], seq_ids, capture: bool):
        """One device call: row r is chunk ids [s] at positions [s] (-1 padded) in slot seq_ids[r];
        the rows are padded to the batch bucket. -> (logits [rows, s, vocab], captures [rows, s, ...])."""
        rows, length = len(chunks), positions[0].numel()
        seq = check_seq_ids(seq_ids, rows, self.slots).tolist()
        size = self.batch_bucket(rows)
        fillers = [s for s in range(self.slots) if s not in seq][:size - rows]
        pad = self.engine.spec.pad_token_id
        padded = [torch.cat([c, torch.full((length - c.numel(),), pad, dtype=torch.long)]) for c in chunks]
        embeds = torch.cat([self.engine.embed(c) for c in [*padded, *[padded[0] * 0 + pad] * len(fillers)]])
        pos = torch.stack([*positions, *[torch.full((length,), -1)] * len(fillers)])
        logits, caps = self.backend.forward(embeds, pos, capture=capture, seq_ids=torch.tensor(seq + fillers))
        return logits[:rows].float(), {k: v[:rows].float() for k, v in caps.items()}

    def prefill(self, prompts: list, seq_ids, capture: bool = False) -> list[PrefillResult]:
        """Prefill each prompt into its slot (seq_ids), ragged prompts in the same calls: per call
        each row with tokens left takes its next chunk, the others are padding. The other slots
        keep their state."""
        ids = [self.engine.validate_ids(p) for p in prompts]
        self.engine._check_capture(capture)
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
        return [PrefillResult(logits=torch.cat(lg), captures={k: torch.cat(v) for k, v in c.items()}, bucket=bucket)
                for lg, c in zip(logits, caps)]

    def decode(self, tokens: list[int], positions: list[int], seq_ids, capture: bool = False) -> list[Step]:
        """One decode step of several sequences, each at its own position in its own slot."""
        self.engine._check_capture(capture)
        for p in positions:
            if p >= self.engine.kv_len:
                raise PromptError(f"position {p} is past the KV length {self.engine.kv_len}; ask for fewer new tokens")
        chunks = [torch.tensor([t]) for t in tokens]
        out, caps = self.forward(chunks, [torch.tensor([p]) for p in positions], seq_ids, capture)
        return [Step(out[r, -1], {k: v[r, -1:] for k, v in caps.items()}) for r in range(len(tokens))]

    def read_cache(self, slot: int, written: int) -> list:
        """Engine.read_cache of one slot: every layer's (k, v) of the sequence in `slot`."""
        rings = ring_windows(self.engine.spec, self.engine.settings.sliding_cache, self.engine.kv_len)
        one = lambda layer, rank: tuple(t[slot:slot + 1] for t in self.backend.kv_cache(layer, rank))  # noqa: E731
        return merge_rank_caches(self.engine.spec, self.backend.tp, one, written, rings)

    def generate(self, prompts: list, new_tokens, capture: bool = False, forced: list | None = None,
                 observe=None) -> list[DecodeResult]:
        """Greedy decode of every prompt with continuous batching: prompts fill the free slots (one
        prefill call for those admitted together), all live sequences decode together, and a
        finished sequence's slot takes the next prompt while the others keep decoding. Results in
        prompt order, each as Engine.generate returns it. `new_tokens` an int or one per prompt;
        `forced` one token list per prompt fed instead of the argmax (teacher forcing);
        `observe(prompt index, slot, written)` after its prefill and after each of its decode steps."""
        ids = [self.engine.validate_ids(p) for p in prompts]
        wants = [new_tokens] * len(ids) if isinstance(new_tokens, int) else list(new_tokens)
        for p, want in zip(ids, wants):
            if want < 0:
                raise PromptError(f"{want} new tokens: ask for 0 or more")
            check_kv_fit(p.numel(), want, self.engine.kv_len)
        self.backend.reset()
        queue, live, done = list(range(len(ids))), [], {}
        while queue or live:
            free = [s for s in range(self.slots) if s not in {q.slot for q in live}]
            admit, queue = queue[:len(free)], queue[len(free):]
            if admit:
                pres = self.prefill([ids[i] for i in admit], free[:len(admit)], capture=capture)
                live += [_Sequence(i, ids[i], s, pre.logits[-1], pre) for i, s, pre in zip(admit, free, pres)]
                for q in live[len(live) - len(admit):]:
                    if observe is not None:
                        observe(q.index, q.slot, q.ids.numel())
            live = self._choose(live, wants, forced, done)
            if live:
                self._step(live, capture, observe)
        return [done[i] for i in range(len(ids))]

    @staticmethod
    def _choose(live: list, wants: list, forced, done: dict) -> list:
        """Each live sequence takes its token (the argmax); the finished ones leave (into `done`),
        the rest are returned with the token each is fed next (forced or chosen) appended."""
        feeding = []
        for q in live:
            if len(q.tokens) < wants[q.index]:
                q.steps.append(q.logits)
                q.tokens.append(int(q.logits.argmax()))
            if len(q.tokens) == wants[q.index]:
                done[q.index] = _result(q)
                continue
            q.fed.append(forced[q.index][len(q.tokens) - 1] if forced is not None else q.tokens[-1])
            feeding.append(q)
        return feeding

    def _step(self, live: list, capture: bool, observe) -> None:
        positions = [q.ids.numel() + len(q.tokens) - 1 for q in live]
        steps = self.decode([q.fed[-1] for q in live], positions, [q.slot for q in live], capture=capture)
        for q, step, position in zip(live, steps, positions):
            q.logits = step.logits
            if capture:
                q.step_caps.append(step.captures)
            if observe is not None:
                observe(q.index, q.slot, position + 1)


def _result(q: _Sequence) -> DecodeResult:
    stacked = {k: torch.cat([c[k] for c in q.step_caps]) for k in q.step_caps[0]} if q.step_caps else {}
    logits = torch.stack(q.steps) if q.steps else torch.empty(0, q.logits.shape[-1])
    return DecodeResult(tokens=q.tokens, step_logits=logits, prefill=q.prefill, step_captures=stacked)
