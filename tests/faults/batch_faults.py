"""Faults only a batch has (issue 29), each injected into the port: `check --batch` must fail on
each and name the sequence it broke. They patch the port (harness.port.model, harness.port.kv_slots,
harness.port.engine, harness.port.blocks) through a pytest MonkeyPatch, like tests/faults/catalog.py.

The 12B's faults run on the tiny fixture with the prompts of BATCH_PROMPTS served by BATCH_SLOTS
slots: the 64-token prompt first, so the 7-token one starts in the slot it leaves (a reused slot
holding keys past the new sequence's positions), and rows of other lengths share every call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from harness.port import engine as port_engine
from harness.port import blocks as port_blocks
from harness.port import kv_cache as port_kv
from harness.port import model as port_model

BATCH_SLOTS = 3
BATCH_BUCKETS, BATCH_KV_LEN, BATCH_NEW_TOKENS = (16, 64), 128, 8


def batch_prompts() -> list[list[int]]:
    """The default prompts of at most 64 tokens, longest first (64, 40, 24, 7)."""
    from harness.inputs.prompts import load_prompts

    return sorted((p for p in load_prompts() if len(p) <= 64), key=len, reverse=True)


def _mask(positions, keys, window, dtype, bound=None, low=None):
    """model.attention_mask with the causal bound (`bound`, [b, 1, s, 1] or broadcastable) and the
    window's lower end (`low`) given: the faults below change them."""
    keys = torch.arange(keys, device=positions.device) if isinstance(keys, int) else keys
    keys = keys[:, None, None, :] if keys.dim() == 2 else keys
    q = positions[:, None, :, None]
    allowed = (keys <= (q if bound is None else bound)) & (keys >= 0) & (q >= 0)
    if window is not None:
        allowed = allowed & (keys > (q if low is None else low) - window)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _patch_mask(monkeypatch, faulty):
    """Replace the mask of calls of several rows by `faulty(positions, keys, window, dtype)`."""
    original = port_model.attention_mask

    def mask(positions, keys, window, dtype):
        return faulty(positions, keys, window, dtype) if positions.shape[0] > 1 else original(positions, keys, window, dtype)

    monkeypatch.setattr(port_model, "attention_mask", mask)


def pad_keys_visible(monkeypatch):
    """The padding mask missing in a batched prefill: a row's queries also see its chunk's padded
    keys (the keys up to the call's bucket), as if every row were as long as the bucket."""
    def faulty(positions, keys, window, dtype):
        mask = _mask(positions, keys, window, dtype)
        if positions.shape[1] == 1 or not isinstance(keys, int):
            return mask
        first = positions[:, :1]
        real_end = (first + (positions >= 0).sum(dim=1, keepdim=True))[:, None, :, None]  # [b, 1, 1, 1]
        k = torch.arange(keys)
        pads = (k >= real_end) & (k < first[:, None, :, None] + positions.shape[1]) & (positions[:, None, :, None] >= 0)
        return mask.masked_fill(pads, 0)

    _patch_mask(monkeypatch, faulty)


def one_row_positions_for_all(monkeypatch):
    """The host feeds the first row's positions to every real row of a call (rope, mask, KV slots)."""
    original = port_engine.Engine.call

    def forward(self, chunks, positions, seq_ids, capture, verify=False):
        real = [p for p in positions if int(p[0]) >= 0]
        shared = [real[0] if int(p[0]) >= 0 else p for p in positions] if real else positions
        return original(self, chunks, shared, seq_ids, capture, verify)

    monkeypatch.setattr(port_engine.Engine, "call", forward)


def window_from_longest(monkeypatch):
    """Sliding layers' window placed by the batch's longest row: a shorter row's window ends where
    the longest row's does, so its queries lose the keys inside their own window."""
    def faulty(positions, keys, window, dtype):
        shift = positions.max() - positions.max(dim=1, keepdim=True).values  # [b, 1]
        return _mask(positions, keys, window, dtype, low=(positions + shift)[:, None, :, None])

    _patch_mask(monkeypatch, faulty)


def kv_write_neighbour_slot(monkeypatch):
    """A row's keys and values written into the next slot (seq_id + 1), while it reads its own."""
    def update(cache, positions, k, v):
        seq = cache.seq_ids.to(torch.long) if cache.seq_ids is not None else torch.arange(k.shape[0])
        first = positions[:, :1].clamp(min=0)
        rows = (first + torch.arange(positions.shape[1]))[:, None, :, None]
        real = (positions >= 0).any(dim=1)[:, None, None, None]
        read = []
        for name, new in (("k", k), ("v", v)):
            buf = getattr(cache, name)
            held = buf.index_select(0, seq)
            written = torch.where(real, held.scatter(2, rows.expand_as(new), new), held)
            setattr(cache, name, buf.index_copy(0, (seq + 1) % buf.shape[0], written))
            read.append(written[:, :, :cache.read_len or buf.shape[2]])
        cache.last_read = tuple(read)
        return cache.last_read

    monkeypatch.setattr(port_kv, "linear_slot_update", update)  # the caches call it by this name


def decode_slot0_length(monkeypatch):
    """A decode call masks every row by the first row's position (slot 0's length read for all)."""
    def faulty(positions, keys, window, dtype):
        if positions.shape[1] != 1:
            return _mask(positions, keys, window, dtype)
        return _mask(positions, keys, window, dtype, bound=positions[:1, None, :, None],
                     low=positions[:1, None, :, None])

    _patch_mask(monkeypatch, faulty)


def reused_slot_stale_keys(monkeypatch):
    """Decode masks a row by its slot's length (the most positions the slot ever held), not by the
    sequence's own: a sequence in a reused slot sees what the previous occupant left past it."""
    held: dict[int, int] = {}
    original_forward, original_reset = port_engine.Engine.call, port_engine.Engine.start
    state = {"bound": None}

    def forward(self, chunks, positions, seq_ids, capture, verify=False):
        if self.slots == 1:  # a batch's fault: a one-slot build's calls stay healthy
            return original_forward(self, chunks, positions, seq_ids, capture, verify)
        seq = [int(s) for s in seq_ids]
        for s, p in zip(seq, positions):
            held[s] = max(held.get(s, -1), int(p.max()))
        state["bound"] = torch.tensor([held[s] for s in seq])
        try:
            return original_forward(self, chunks, positions, seq_ids, capture, verify)
        finally:
            state["bound"] = None

    def reset(self):
        held.clear()  # the decode loop starts from a reset cache
        return original_reset(self)

    original_mask = port_model.attention_mask

    def mask(positions, keys, window, dtype):  # a sequence alone in its call too
        if positions.shape[1] != 1 or state["bound"] is None:
            return original_mask(positions, keys, window, dtype)
        bound = torch.cat([state["bound"], positions[len(state["bound"]):, 0]])  # filler rows: their own
        return _mask(positions, keys, window, dtype, bound=torch.maximum(bound, positions[:, 0])[:, None, None, None])

    monkeypatch.setattr(port_engine.Engine, "call", forward)
    monkeypatch.setattr(port_engine.Engine, "start", reset)
    monkeypatch.setattr(port_model, "attention_mask", mask)


def ple_row_of_other_sequence(monkeypatch):
    """Each row combined with the next row's per-layer table rows (another sequence's tokens)."""
    original = port_blocks.PerLayerInputs.forward

    def forward(self, embeds, table_rows):
        return original(self, embeds, table_rows.roll(1, dims=0))

    monkeypatch.setattr(port_blocks.PerLayerInputs, "forward", forward)


def routing_row_of_other_sequence(monkeypatch):
    """Each row's tokens routed (experts and weights) by the next row's router output."""
    original = port_blocks.Router.forward

    def forward(self, x):
        logits, weights, chosen = original(self, x)
        rows = getattr(self, "_rows", 1)
        shift = x.shape[0] // rows
        return logits, weights.roll(shift, dims=0), chosen.roll(shift, dims=0)

    original_ff = port_blocks.FamilyDecoderLayer.feed_forward

    def feed_forward(self, h, captures, prefix):
        if self.moe:
            self.router._rows = h.shape[0]
        return original_ff(self, h, captures, prefix)

    monkeypatch.setattr(port_blocks.Router, "forward", forward)
    monkeypatch.setattr(port_blocks.FamilyDecoderLayer, "feed_forward", feed_forward)


@dataclass(frozen=True)
class BatchFault:
    name: str
    description: str
    inject: Callable
    sequences: tuple[int, ...]  # the prompts (sequences) the check may name first
    variant: str | None = None  # a family variant (tests/family/shared.py); None: the tiny 12B


BATCH_CATALOG = [
    BatchFault("batch-pad-keys-visible", "a row's queries see its chunk's padded keys", pad_keys_visible, (1, 2, 3)),
    BatchFault("batch-one-row-positions", "the first row's positions fed to every row", one_row_positions_for_all,
               (1, 2, 3)),
    BatchFault("batch-window-from-longest", "the sliding window placed by the longest row", window_from_longest,
               (1, 2, 3)),
    BatchFault("batch-kv-write-neighbour-slot", "KV written into the neighbouring slot", kv_write_neighbour_slot,
               (0, 1, 2, 3)),
    BatchFault("batch-decode-slot0-length", "decode masks every row by the first row's position",
               decode_slot0_length, (1, 2, 3)),
    BatchFault("batch-reused-slot-stale-keys", "decode masks by the slot's length: a reused slot's old keys seen",
               reused_slot_stale_keys, (3,)),
    BatchFault("batch-ple-row-of-other-sequence", "per-layer inputs from another row", ple_row_of_other_sequence,
               (0, 1, 2, 3), variant="e2b"),
    BatchFault("batch-routing-row-of-other-sequence", "routing from another row", routing_row_of_other_sequence,
               (0, 1, 2, 3), variant="26b-a4b"),
]


@functools.lru_cache(maxsize=None)
def batch_reference():
    """fp32 and bf16 references of batch_prompts() on the tiny fixture (seed 0)."""
    from harness.inputs.tiny import tiny_checkpoint
    from harness.reference.run import run_reference

    return run_reference(tiny_checkpoint(seed=0), batch_prompts(), new_tokens=BATCH_NEW_TOKENS)


def run_batch_check(fault: BatchFault | None, monkeypatch, variant: str | None = None, backend: str = "cpu"):
    """`check --batch` (both stages, no local verdicts) of the tiny 12B (or a family variant, on its
    family prompts with 4 slots) with `fault` injected, the bf16 stage on `backend` (neuron: inside
    the NxD double, tests/nxd_double, set up by the caller)."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import tiny_checkpoint
    from harness.parity.check import check_port

    variant = fault.variant if fault is not None else variant
    if variant is None:
        ckpt, refs, slots = Checkpoint.open(tiny_checkpoint(seed=0)), batch_reference(), BATCH_SLOTS
        options = {"buckets": BATCH_BUCKETS, "kv_len": BATCH_KV_LEN}
    else:
        from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_KV_LEN
        from tests.family.shared import family_checkpoint, family_reference

        ckpt, refs, slots = family_checkpoint(variant), family_reference(variant), 4
        options = {"buckets": FAMILY_BUCKETS, "kv_len": FAMILY_KV_LEN}
    if fault is not None:
        fault.inject(monkeypatch)
    engine = build_engine(ckpt, RunSettings(backend=backend, tp=2, batch=slots, **options), capture=True)
    return check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=False)


def named_sequences(result) -> set[int]:
    """The prompts (sequences) the check's first failure of each failing stage names."""
    names = set()
    for stage in (result.bf16, result.fp32):
        failures = stage.failures() if stage is not None else []
        where = failures[0].get("where", "") if failures else ""
        if where.startswith("prompt "):
            names.add(int(where.split()[1]))
    return names
