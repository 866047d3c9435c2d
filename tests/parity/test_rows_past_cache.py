"""A call whose rows would write past the linear KV cache is refused before any device call
(issue 46): the cache addresses [slots * kv_heads * len] rows (harness/port/kv_slots.py), so a row
past `len` would land in the next head's or slot's rows without a word. Every backend's forward
checks its positions (graphs.kv_read_length -> kv_slots.check_positions); the Neuron backend's
check runs through the NxD double in tests/parity/test_neuron_double.py and, batched,
tests/parity/test_neuron_batch_double.py."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.port.graphs import input_width

KV_LEN = 32


def _row(start: int, real: int, length: int = 16) -> list[int]:
    """A chunk of `length` positions: `real` real ones from `start`, then padding (-1)."""
    return list(range(start, start + real)) + [-1] * (length - real)


# (positions of row 0, what the refusal names); each landed in another head's or slot's cache rows
# (or raised an IndexError from a rank thread at batch 1) before the check
PAST = [
    (_row(KV_LEN - 8, 8), rf"writes cache rows up to {KV_LEN + 7}, past the KV cache length {KV_LEN}"),
    ([-1] * 15 + [KV_LEN + 8], rf"position {KV_LEN + 8} is past the KV cache length {KV_LEN}"),
    (_row(0, 15) + [KV_LEN + 3], rf"position {KV_LEN + 3} is past the KV cache length {KV_LEN}"),
    ([KV_LEN], rf"position {KV_LEN} is past the KV cache length {KV_LEN}"),
]


def _caches(be) -> list[torch.Tensor]:
    return [t.clone() for layer in range(be.spec.num_layers) for t in be.kv_cache(layer, 0)]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_row_past_the_cache_is_refused_and_writes_nothing(tiny0_ckpt, batch):
    engine = build_engine(tiny0_ckpt, RunSettings(backend="cpu", tp=1, batch=batch, buckets=(16,), kv_len=KV_LEN))
    be, width = engine.backend, input_width(engine.backend.spec)
    engine.prefill_rows([[5] * 20] * batch, list(range(batch)))  # real keys in every slot, both heads
    before = _caches(be)
    for row0, says in PAST:
        positions = torch.tensor([row0] + [[-1] * len(row0)] * (batch - 1))
        slots = {"seq_ids": torch.arange(batch)} if batch > 1 else {}
        with pytest.raises(HarnessInputError, match=says) as refused:
            be.forward(torch.ones(batch, len(row0), width, dtype=torch.bfloat16), positions, **slots)
        assert "raise --kv-len" in str(refused.value)
        assert all(torch.equal(a, b) for a, b in zip(before, _caches(be))), row0  # refused before any write
    # a row of padding only (a batch bucket's filler) and padded rows inside the cache still run
    positions = torch.tensor([_row(KV_LEN - 16, 8)] + [[-1] * 16] * (batch - 1))
    logits, _ = be.forward(torch.ones(batch, 16, width, dtype=torch.bfloat16), positions,
                           **({"seq_ids": torch.arange(batch)} if batch > 1 else {}))
    assert logits.shape[0] == batch

