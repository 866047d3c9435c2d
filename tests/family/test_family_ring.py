"""The ring cache on KV-shared models (E2B/E4B): a shared layer reads what its source's attention
read in the same call (a ring as it was before the chunk, then the chunk's keys), so `check` passes
with `--sliding-cache ring`, prefill in one chunk or in window-sized chunks; a shared layer that
reads the ring after its source wrote the chunk (slots the chunk's earlier queries still need,
overwritten) fails it."""

from __future__ import annotations

import pytest
import torch

from harness.port import blocks as port_blocks
from harness.port import kv_cache as port_kv
from tests.family.shared import family_checkpoint, family_reference


def _check(variant: str, buckets: tuple):
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port
    from tests.faults.catalog import FAMILY_KV_LEN

    ckpt, refs = family_checkpoint(variant), family_reference(variant)
    settings = RunSettings(tp=2, buckets=buckets, kv_len=FAMILY_KV_LEN, sliding_cache="ring")
    engine = build_engine(ckpt, settings, capture=True)
    return ckpt, check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=False)


# The ring on shared layers (both cases here, about 10 CPU-seconds each) runs in the slow lane; the
# default lane keeps the ring's own tests (tests/parity/test_long_context.py) and the family checks.
@pytest.mark.parametrize("variant, buckets", [pytest.param("e4b", (64,), marks=pytest.mark.slow),
                                              pytest.param("e2b", (16,), marks=pytest.mark.slow)])
def test_ring_cache_on_shared_layers_passes(variant, buckets):
    ckpt, result = _check(variant, buckets)
    assert any(layer.is_sliding and layer.window < 64 for layer in ckpt.spec.layers) and ckpt.spec.shared_layers
    assert result.fp32.passed and result.passed, result.failures() + result.fp32.failures()


@pytest.mark.slow
def test_shared_layer_reading_the_written_ring_fails(monkeypatch):
    original = port_blocks.SharedKVAttention.forward

    def forward(self, x, cos, sin, positions, mask):
        cache = self.source_cache
        if isinstance(cache, port_kv.RingCache):  # the ring after the write, then the chunk
            k, v = cache.last_read
            w = cache.k.shape[2]
            cache.last_read = torch.cat([cache.k, k[:, :, w:]], 2), torch.cat([cache.v, v[:, :, w:]], 2)
        return original(self, x, cos, sin, positions, mask)

    monkeypatch.setattr(port_blocks.SharedKVAttention, "forward", forward)
    # window-sized chunks: the second chunk's queries need the first chunk's keys the write replaced
    ckpt, result = _check("e4b", (16,))
    assert not result.fp32.passed
    layer, component = result.fp32.divergent()
    assert layer in ckpt.spec.shared_layers and component == "attention"
