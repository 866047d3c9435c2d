"""A KV cache of several sequences: one slot per sequence, `[slots, kv_heads, len, d]`, and a call
that names the slots its rows work on (`seq_ids`, as NxD Inference passes them).

A call moves only the KV rows it touches, as NxD Inference's KV cache manager does: row r scatters
its new keys into slot seq_ids[r] at its own positions and reads back only that slot's first
`read_len` keys (the graph's KV bucket) on a linear cache, or that slot's ring on a ring. Nothing
else of the cache is read or rewritten: a call's KV traffic is bounded by batch x (bucket + new
rows), not by the cache (harness/hlo/kv_traffic.py states the bound on the lowered graphs). The
cache is addressed as rows of `d` values ([slots * kv_heads * len, d], a view of the buffer) so the
scatter and the reads are each one index op over exactly the rows they move.

Nothing is ever zeroed to hide a previous occupant: every mask is by each row's own positions (a
slot's keys past the row's position are invisible by causality, a ring's slots by the absolute
position each holds), so a reused slot needs no reset. A row of padding only (all positions -1, a
batch bucket's filler) writes its slot's rows back unchanged. Shapes are static; the slots a call
names must be distinct.

kv_cache.KVCache and kv_cache.RingCache call these when a call names its slots (`cache.seq_ids` set) or
the cache holds several (row r then in slot r); a cache of one sequence without seq_ids keeps the
one-sequence path of batch 1.
"""

from __future__ import annotations

import torch

from harness.base.errors import HarnessInputError


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


def slot_rows(buf: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[b * kv_heads * n] indices into `buf` viewed as rows of d values ([slots * kv_heads * len, d]):
    slot seq[r], every head, position rows[r, j] ([b, n]), in [b, kv_heads, n] order."""
    _, heads, length, _ = buf.shape
    head = torch.arange(heads, device=buf.device)
    return ((seq[:, None, None] * heads + head[None, :, None]) * length + rows[:, None, :]).reshape(-1)


def _scatter_rows(buf: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`buf` with rows [b, kv_heads, n, d] written at `index` (slot_rows); nothing else touched."""
    flat = buf.reshape(-1, buf.shape[-1])
    return flat.index_copy(0, index, rows.reshape(-1, buf.shape[-1])).reshape(buf.shape)


def _gather_rows(buf: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of `buf` at `index` (slot_rows) as [b, kv_heads, rows, d]."""
    heads, d = buf.shape[1], buf.shape[-1]
    return buf.reshape(-1, d).index_select(0, index).reshape(-1, heads, rows, d)


def read_slot(buf: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    """[1, kv_heads, n, d]: the first `n` positions of slot seq[0] (a draft step's read of its own
    sequence's keys or values; nothing of another slot is read)."""
    return _gather_rows(buf, slot_rows(buf, seq, torch.arange(n, device=buf.device)[None]), n)


def carry_slot(buf: torch.Tensor, seq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """`buf` with slot seq[0]'s rows at `position` ([1, 1]) rewritten with themselves: a new tensor
    of the same values (a draft graph's reassignment of the cache, harness/port/draft_graphs.py),
    touching only those rows."""
    index = slot_rows(buf, seq, position)
    return _scatter_rows(buf, index, _gather_rows(buf, index, position.shape[1]))


def linear_slot_update(cache, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Scatter each row's chunk into its slot at the row's positions (a chunk's padded rows after its
    real ones, hidden by causality as in batch 1; a padding-only row writes back what it finds) and
    return each row's slot, its first read_len keys: [b, kv_heads, read_len, d] each."""
    seq = _slots(cache, k.shape[0])
    real = (positions >= 0).any(dim=1)[:, None, None, None]
    first = positions[:, :1].clamp(min=0)
    written = slot_rows(cache.k, seq, first + torch.arange(positions.shape[1], device=positions.device))
    n = cache.read_len or cache.k.shape[2]
    read = slot_rows(cache.k, seq, torch.arange(n, device=positions.device).expand(k.shape[0], n))
    out = []
    for name, new in (("k", k), ("v", v)):
        buf = getattr(cache, name)
        held = _gather_rows(buf, written, new.shape[2])
        buf = _scatter_rows(buf, written, torch.where(real, new, held))
        setattr(cache, name, buf)
        out.append(_gather_rows(buf, read, n))
    cache.last_read = tuple(out)
    return cache.last_read


def ring_key_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[b, window + s]: per row, the absolute position of each ring slot before the chunk, then the
    chunk's own positions (what ring_slot_update returns for attention to read)."""
    return torch.cat([ring_slot_positions(positions[:, :1], window), positions], dim=1)


def ring_slot_update(cache, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """kv_cache.RingCache.update per row: each row's ring as it was before its chunk followed by the
    chunk's keys is returned; then each real row of a chunk shorter than the ring is scattered into
    its ring slot (position % window), and a chunk as long as the ring or longer rewrites the ring
    with the latest real row mapping to each slot (the rows it touches are the whole ring)."""
    seq, window = _slots(cache, k.shape[0]), cache.window
    first, length = positions[:, :1], positions.shape[1]
    prior = {name: getattr(cache, name).index_select(0, seq) for name in ("k", "v")}
    if length < window:  # distinct ring slots: a scatter of the chunk's rows
        ring = torch.remainder(first + torch.arange(length, device=positions.device), window)  # [b, s]
        index = slot_rows(cache.k, seq, ring)
        real = (positions >= 0)[:, None, :, None]
        gather = ring[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        for name, new in (("k", k), ("v", v)):
            rows = torch.where(real, new, prior[name].gather(2, gather))
            setattr(cache, name, _scatter_rows(getattr(cache, name), index, rows))
    else:
        slot_pos = ring_slot_positions(first + (positions >= 0).sum(dim=1, keepdim=True), window)
        row = slot_pos - first  # [b, window]: the chunk row each slot takes; negative: it keeps its key
        take = (row >= 0)[:, None, :, None]
        index = row.clamp(min=0)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        for name, new in (("k", k), ("v", v)):
            buf = getattr(cache, name)
            setattr(cache, name, buf.index_copy(0, seq, torch.where(take, new.gather(2, index), prior[name])))
    cache.last_read = torch.cat([prior["k"], k], dim=2), torch.cat([prior["v"], v], dim=2)
    return cache.last_read


def check_positions(positions: torch.Tensor, kv_len: int) -> None:
    """Refuse, before any device call, a call whose rows would write past the linear cache: the
    cache writes row r's chunk at cache rows first..first+s-1 (its first position onwards) and
    slot_rows addresses [slots * kv_heads * len] rows, so a row past `kv_len` lands in the next
    head's or slot's rows (one index op over the flattened buffer: nothing on the device refuses it). A row's real positions
    must be its first ones, running on from the first; padding (-1) after them. A row of padding
    only writes nothing and is always allowed; padded rows inside the cache are hidden by causality."""
    length = positions.shape[-1]
    for r, row in enumerate(positions.reshape(-1, length).to(torch.long)):
        real = int((row >= 0).sum())
        if not real:
            continue
        first, last = int(row[0]), int(row.max())
        if last >= kv_len:
            raise HarnessInputError(f"row {r}: position {last} is past the KV cache length {kv_len} (cache rows "
                                    f"0..{kv_len - 1}); its keys would land in the next head's or slot's rows: "
                                    "ask for fewer tokens or raise --kv-len")
        if first < 0 or row[:real].tolist() != list(range(first, first + real)):
            raise HarnessInputError(f"row {r}: positions {row.tolist()} are not one run from the row's first "
                                    "position with padding (-1) after it; the cache writes a row's chunk "
                                    "from its first position on")
        if first + length > kv_len:
            raise HarnessInputError(f"row {r}: a chunk of {length} rows from position {first} writes cache rows "
                                    f"up to {first + length - 1}, past the KV cache length {kv_len}; its padded "
                                    "rows would land in the next head's or slot's rows: call a shorter bucket "
                                    "(the engine's chunk_bucket does) or raise --kv-len")


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


def call_seq_ids(seq_ids, rows: int, slots: int) -> torch.Tensor:
    """A backend's forward check of the slots a call names (row r in slot r when None): check_seq_ids
    as a clear input error (a device clamps or drops an out-of-range index without a word). More
    rows than slots is left to the caller's batch-bucket check, which names the buckets."""
    ids = torch.arange(rows) if seq_ids is None else torch.as_tensor(seq_ids).reshape(-1)
    if rows > slots:
        return ids
    try:
        return check_seq_ids(ids, rows, slots)
    except ValueError as exc:
        raise HarnessInputError(f"{exc}: name one distinct KV slot of the build's {slots} (--batch) per row") from None
