"""The per-rank decoder's KV caches: a layer's linear cache (key j in slot j) or a sliding layer's
ring (`--sliding-cache ring`, docs/long-context.md), of one or more sequences' slots (the slot
writes are harness/port/kv_slots.py's)."""

from __future__ import annotations

import torch
from torch import nn

from harness.inputs.spec import LayerSpec
from harness.port.kv_slots import linear_slot_update, ring_key_positions, ring_slot_positions, ring_slot_update


SLIDING_CACHES = ("linear", "ring")  # how sliding layers keep their keys (docs/long-context.md)


def chunk_rows(positions: torch.Tensor) -> torch.Tensor:
    """Cache slots of a chunk's rows in a linear cache: its first position onwards, padded rows
    (position -1, after the real ones) included, hidden by later writes or causality."""
    return positions[0, :1] + torch.arange(positions.shape[-1], device=positions.device)


class KVCache(nn.Module):
    """Linear cache of the compiled max length, written at absolute positions: key j in slot j.
    update writes the chunk, then returns the whole cache for attention to read."""

    def __init__(self, kv_heads: int, max_len: int, head_dim: int, dtype, slots: int = 1):
        super().__init__()
        self.register_buffer("k", torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype), persistent=False)
        self.seq_ids: torch.Tensor | None = None  # the slot of each row of this call (kv_slots); None: batch 1
        # Slots attention reads: the graph's KV bucket (graphs.kv_read_length); None: the whole cache.
        self.read_len: int | None = None
        # What the last update returned for attention to read (a KV-shared layer reads it too).
        self.last_read: tuple[torch.Tensor, torch.Tensor] | None = None

    def key_positions(self, positions: torch.Tensor):
        """What attention_mask needs for the keys update returns: their count (slot = position)."""
        return self.read_len or self.k.shape[2]

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if self.seq_ids is not None or self.k.shape[0] > 1:  # slots (kv_slots); reassigning the buffers
            return linear_slot_update(self, positions, k, v)  # (not in-place): NxD's aliased state
        rows = chunk_rows(positions)
        self.k = self.k.index_copy(2, rows, k)
        self.v = self.v.index_copy(2, rows, v)
        n = self.read_len or self.k.shape[2]
        self.last_read = self.k[:, :, :n], self.v[:, :, :n]
        return self.last_read


class RingCache(KVCache):
    """A sliding layer's rolling cache: `window` slots, position p in slot p % window.

    update returns the ring as it was before this chunk (the prefix still in the window) followed
    by the chunk's own keys, and only then writes the chunk: a chunk's earlier queries still see
    the keys its later rows overwrite. The mask reads each key's absolute position (key_positions).
    Decode writes its one row into its slot; a prefill chunk's slots each take the latest real row
    mapping to them (padded rows, position -1, write nothing): a gather and a select, no scatter
    with repeated indices, static shapes."""

    def __init__(self, kv_heads: int, window: int, head_dim: int, dtype, slots: int = 1):
        super().__init__(kv_heads, window, head_dim, dtype, slots)
        self.window = window

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return ring_key_positions(positions, self.window)  # [b, window + s]: per row

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if self.seq_ids is not None or self.k.shape[0] > 1:
            return ring_slot_update(self, positions, k, v)
        prior_k, prior_v = self.k, self.v
        if k.shape[2] == 1:  # decode (static per graph): one row into its slot, not every slot rewritten
            slot = torch.remainder(positions[0], self.window)
            self.k, self.v = prior_k.index_copy(2, slot, k), prior_v.index_copy(2, slot, v)
        else:
            first = positions[0, 0]
            written_to = first + (positions[0] >= 0).sum()  # one past the chunk's last real position
            row = ring_slot_positions(written_to, self.window) - first  # < 0: the slot keeps its key
            take, rows = (row >= 0)[None, None, :, None], row.clamp(min=0)
            self.k = torch.where(take, k.index_select(2, rows), prior_k)
            self.v = torch.where(take, v.index_select(2, rows), prior_v)
        self.last_read = torch.cat([prior_k, k], dim=2), torch.cat([prior_v, v], dim=2)
        return self.last_read


def make_cache(kind: str, layer: LayerSpec, kv_heads: int, max_len: int, dtype, slots: int = 1) -> KVCache:
    """A layer's cache of `slots` sequences: a ring of `window` slots on a sliding layer when "ring"."""
    if kind not in SLIDING_CACHES:
        raise ValueError(f"sliding cache {kind!r}: choose one of {SLIDING_CACHES}")
    if kind == "ring" and layer.is_sliding and layer.window < max_len:
        return RingCache(kv_heads, layer.window, layer.head_dim, dtype, slots)
    return KVCache(kv_heads, max_len, layer.head_dim, dtype, slots)
