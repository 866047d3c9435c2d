"""A ring's decode step writes its one row (one slot), not every slot of the window; its keys and
values are what the prefill path would have written."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.port.kv_cache import RingCache


class CacheSizedOps(TorchDispatchMode):
    """The ops whose output has the ring's shape: what produces or rewrites the whole ring."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.ops = tuple(shape), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.ops.add(func.overloadpacket.__name__)
        return out


def _ring(window=8, seed=0):
    torch.manual_seed(seed)
    ring = RingCache(2, window, 4, torch.float32)
    ring.k, ring.v = torch.randn_like(ring.k), torch.randn_like(ring.v)
    return ring


@pytest.mark.parametrize("position", [0, 5, 8, 13, 31])
def test_decode_writes_one_slot_as_the_chunk_path_would(position):
    ring, chunk = _ring(), _ring()
    k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    pos = torch.tensor([[position]])
    with CacheSizedOps(ring.k.shape) as seen:
        read = ring.update(pos, k, v)
    assert seen.ops <= {"index_copy"}, seen.ops  # no select over every slot
    slot = position % 8
    assert torch.equal(ring.k[:, :, slot], k[:, :, 0]) and torch.equal(ring.v[:, :, slot], v[:, :, 0])
    others = [s for s in range(8) if s != slot]
    assert torch.equal(ring.k[:, :, others], chunk.k[:, :, others])
    # the prefill path (a chunk of 2: the real row then a padded one) writes the same ring
    pad = torch.tensor([[position, -1]])
    chunk.update(pad, torch.cat([k, torch.zeros_like(k)], 2), torch.cat([v, torch.zeros_like(v)], 2))
    assert torch.equal(ring.k, chunk.k) and torch.equal(ring.v, chunk.v)
    assert torch.equal(read[0], torch.cat([_ring().k, k], 2))  # reads the ring before the write, then the row
