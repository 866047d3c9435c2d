"""A KV cache of several sequences: one slot per sequence, `[slots, kv_heads, len, d]`, and a call
that names the slots its rows work on (`seq_ids`, as NxD Inference passes them).

Row r of a call reads and writes only slot seq_ids[r]: the slot is gathered, the row's chunk written
into it at the row's own positions, and the slot written back; attention reads that row's slot.
Nothing is ever zeroed to hide a previous occupant: every mask is by each row's own positions (a
slot's keys past the row's position are invisible by causality, a ring's slots by the absolute
position each holds), so a reused slot needs no reset. A row of padding only (all positions -1, a
batch bucket's filler) writes nothing: its slot is written back unchanged. Shapes are static; the
slots a call names must be distinct.

model.KVCache and model.RingCache call these when a call names its slots (`cache.seq_ids` set) or
the cache holds several (row r then in slot r); a cache of one sequence without seq_ids keeps the
one-sequence path of batch 1.
"""

from __future__ import annotations

import torch


def ring_slot_positions(next_position: torch.Tensor, window: int) -> torch.Tensor:
    """[..., window] absolute position each ring slot holds once positions [0, next_position) are
    written (slot s holds the latest position p < next_position with p % window == s; negative: never
    written). `next_position` a scalar, or [b, 1] for one value per row."""
    slots = torch.arange(window, device=next_position.device)
    last = next_position - 1
    return last - torch.remainder(last - slots, window)


def _slots(cache, rows: int) -> torch.Tensor:
    """The slot of each row: the call's seq_ids, or row r in slot r when the call names none."""
    if cache.seq_ids is None:
        return torch.arange(rows, device=cache.k.device)
    return cache.seq_ids.to(torch.long).reshape(-1)


def linear_slot_update(cache, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Write each row's chunk into its slot at the row's positions (a chunk's padded rows after its
    real ones, hidden by causality as in batch 1) and return each row's slot, its first read_len keys."""
    seq = _slots(cache, k.shape[0])
    real = (positions >= 0).any(dim=1)[:, None, None, None]
    first = positions[:, :1].clamp(min=0)
    rows = (first + torch.arange(positions.shape[1], device=positions.device))[:, None, :, None]
    read = []
    for name, new in (("k", k), ("v", v)):
        buf = getattr(cache, name)
        held = buf.index_select(0, seq)
        written = torch.where(real, held.scatter(2, rows.expand_as(new), new), held)
        setattr(cache, name, buf.index_copy(0, seq, written))
        read.append(written[:, :, :cache.read_len or buf.shape[2]])
    cache.last_read = tuple(read)
    return cache.last_read


def ring_key_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[b, window + s]: per row, the absolute position of each ring slot before the chunk, then the
    chunk's own positions (what ring_slot_update returns for attention to read)."""
    return torch.cat([ring_slot_positions(positions[:, :1], window), positions], dim=1)


def ring_slot_update(cache, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """model.RingCache.update per row: each row's ring as it was before its chunk followed by the
    chunk's keys is returned, then each slot takes the latest real row of the chunk mapping to it."""
    seq = _slots(cache, k.shape[0])
    first = positions[:, :1]
    slot_pos = ring_slot_positions(first + (positions >= 0).sum(dim=1, keepdim=True), cache.window)
    row = slot_pos - first  # [b, window]: the chunk row each slot takes; negative: it keeps its key
    take = (row >= 0)[:, None, :, None]
    index = row.clamp(min=0)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    read = []
    for name, new in (("k", k), ("v", v)):
        buf = getattr(cache, name)
        prior = buf.index_select(0, seq)
        setattr(cache, name, buf.index_copy(0, seq, torch.where(take, new.gather(2, index), prior)))
        read.append(torch.cat([prior, new], dim=2))
    cache.last_read = tuple(read)
    return cache.last_read


def check_seq_ids(seq_ids, rows: int, slots: int) -> torch.Tensor:
    """seq_ids as a [rows] long tensor, or a ValueError naming what is wrong: one distinct slot in
    [0, slots) per row."""
    ids = torch.as_tensor(seq_ids, dtype=torch.long).reshape(-1)
    if ids.numel() != rows:
        raise ValueError(f"seq_ids {ids.tolist()}: {ids.numel()} slots named for {rows} rows")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= slots):
        raise ValueError(f"seq_ids {ids.tolist()}: a slot outside [0, {slots}) (the cache has {slots} slots)")
    if len(set(ids.tolist())) != ids.numel():
        raise ValueError(f"seq_ids {ids.tolist()}: a slot named twice in one call")
    return ids
