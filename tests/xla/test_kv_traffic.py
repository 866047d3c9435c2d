"""The KV-traffic contract (harness/hlo/kv_traffic.py) on what torch-xla lowered: every graph of a
batched build (each batch bucket x sequence bucket x KV bucket, linear and ring caches) reads and
writes within batch x (bucket + new rows), and the whole-slot rewrite the batched cache used to do
(gather each named slot whole, write it back whole) fails it. The batched perf build's graphs
return one row of logits per sequence."""

from __future__ import annotations

import pytest
import torch

from harness.hlo.contracts import graph_stats
from harness.hlo.kv_traffic import kv_bounds, kv_traffic
from harness.port.graphs import batch_buckets, kv_graph_plan
from tests.xla.conftest import BUCKET

pytestmark = pytest.mark.xla

KV = 32  # KV buckets 16 and 32 under the bucket of 16: a graph reading 16 keys of a 32-long cache
SLOTS = 4


def lower_batched(spec, length: int, batch: int, kv_read: int, sliding_cache: str = "linear", capture: bool = False):
    from harness.backends.xla_lower import build_graph_module, graph_tensors, lower_graph

    module = build_graph_module(spec, 1, KV, torch.bfloat16, capture=capture, sliding_cache=sliding_cache, slots=SLOTS)
    module.set_kv_read(kv_read)
    tensors, roles = graph_tensors(module)
    graph = lower_graph(module, tensors, roles, f"len{length}_kv{kv_read}_bs{batch}", length, batch=batch)
    bounds = kv_bounds(spec, 1, KV, length, batch, kv_read, nbytes=2, sliding_cache=sliding_cache)
    return graph, bounds


@pytest.mark.parametrize("sliding_cache", ["linear", "ring"])
def test_every_batched_graph_moves_only_the_rows_it_touches(tiny_spec, sliding_cache):
    """Every graph of a perf build of 4 slots (buckets (16,), KV 32: 4 graphs x batch buckets 1, 2, 4)."""
    for tag, length, kv in kv_graph_plan((BUCKET,), KV):
        for batch in batch_buckets(SLOTS):
            graph, bounds = lower_batched(tiny_spec, length, batch, kv, sliding_cache)
            assert kv_traffic(graph.hlo, graph.params, bounds) == [], (tag, batch)
            if sliding_cache == "linear":  # one row of logits per sequence (lm_head on one row each)
                returned = graph_stats(graph.hlo, _sig(graph)).returned_bytes
                assert returned == batch * tiny_spec.vocab_size * 2, (tag, batch)


def _sig(graph):
    from harness.hlo.contracts import GraphSignature

    return GraphSignature(graph.params, graph.outputs, graph.host_transfers)


def _whole_slot_linear(cache, positions, k, v):
    """The batched linear write as it was: each named slot gathered whole, written back whole."""
    seq = torch.arange(k.shape[0], device=k.device) if cache.seq_ids is None else cache.seq_ids.to(torch.long).reshape(-1)
    real = (positions >= 0).any(dim=1)[:, None, None, None]
    rows = (positions[:, :1].clamp(min=0) + torch.arange(positions.shape[1], device=k.device))[:, None, :, None]
    read = []
    for name, new in (("k", k), ("v", v)):
        buf = getattr(cache, name)
        held = buf.index_select(0, seq)
        written = torch.where(real, held.scatter(2, rows.expand_as(new), new), held)
        setattr(cache, name, buf.index_copy(0, seq, written))
        read.append(written[:, :, :cache.read_len or buf.shape[2]])
    cache.last_read = tuple(read)
    return cache.last_read


def test_a_whole_slot_rewrite_fails_the_contract(tiny_spec, monkeypatch):
    from harness.port import kv_cache as model  # the caches call the slot updates by this module's names

    monkeypatch.setattr(model, "linear_slot_update", _whole_slot_linear)
    graph, bounds = lower_batched(tiny_spec, 1, 2, 16)
    violations = kv_traffic(graph.hlo, graph.params, bounds)
    layers = tiny_spec.num_layers
    assert len([v for v in violations if " writes " in v]) == 2 * layers, violations
    assert len([v for v in violations if " reads " in v]) == 2 * layers, violations  # 32 keys read of 16


def test_a_ring_rewritten_whole_at_decode_fails_the_contract(tiny_spec, monkeypatch):
    """A decode step that selects every ring slot (the chunk path for one row) rewrites the ring."""
    from harness.port import kv_cache as model  # the caches call the slot updates by this module's names

    def whole_ring(cache, positions, k, v):
        seq = cache.seq_ids.to(torch.long).reshape(-1)
        slot = torch.remainder(positions[:, :1], cache.window)  # [b, 1]
        take = (torch.arange(cache.window, device=slot.device)[None] == slot)[:, None, :, None]
        out = []
        for name, new in (("k", k), ("v", v)):
            prior = getattr(cache, name).index_select(0, seq)
            setattr(cache, name, getattr(cache, name).index_copy(0, seq, torch.where(take, new, prior)))
            out.append(torch.cat([prior, new], dim=2))
        cache.last_read = tuple(out)
        return cache.last_read

    monkeypatch.setattr(model, "ring_slot_update", whole_ring)
    graph, bounds = lower_batched(tiny_spec, 1, 2, KV, "ring")
    violations = kv_traffic(graph.hlo, graph.params, bounds)
    sliding = sum(1 for layer in tiny_spec.layers if layer.window)
    assert len([v for v in violations if " writes " in v]) == 2 * sliding, violations
