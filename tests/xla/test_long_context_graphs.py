"""Long context in the XLA lane: the graphs read only their KV bucket (a decode step early in a long
cache does not read the whole cache), the ring build's state is its window and its attention reads
window + s keys, and the long-prompt check passes on the xla backend at TP=1 and TP=2 in fp32."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.hlo.contracts import GraphSignature, check_graph
from harness.hlo.expectation import expectation_for
from harness.parity.check import check_port
from harness.port.graphs import TracedDecoder, kv_buckets
from tests.faults.catalog import LONG_BUCKETS, LONG_KV_LEN
from tests.xla.conftest import BUCKET, KV_LEN

pytestmark = pytest.mark.xla


def _lowered(spec, tp, length, kv_read=None, sliding_cache="linear", module_cls=TracedDecoder):
    from harness.backends.xla_lower import build_graph_module, graph_tensors, lower_graph

    module = build_graph_module(spec, tp, KV_LEN, torch.bfloat16, module_cls=module_cls, sliding_cache=sliding_cache)
    module.set_kv_read(kv_read)
    tensors, roles = graph_tensors(module)
    graph = lower_graph(module, tensors, roles, f"len{length}-kv{kv_read}", length)
    sig = GraphSignature(graph.params, graph.outputs, graph.host_transfers)
    return graph, sig, module


@pytest.mark.parametrize("length", [BUCKET, 1], ids=["prefill", "decode"])
def test_graphs_read_only_their_kv_bucket(tiny_spec, length):
    """At KV bucket 16 of a 64-slot cache every attention dot reads 16 keys; the contract that
    expects the bucket holds, and the same graph judged against an expectation of a smaller bucket
    fails (it reads more than that bucket)."""
    assert kv_buckets((BUCKET,), KV_LEN) == (16, 32, KV_LEN)
    graph, sig, _ = _lowered(tiny_spec, 2, length, kv_read=16)
    assert check_graph(graph.hlo, sig, expectation_for(tiny_spec, 2, KV_LEN, length, torch.bfloat16, kv_read=16)) == []
    whole, whole_sig, _ = _lowered(tiny_spec, 2, length)  # a build that reads the whole cache
    violated = check_graph(whole.hlo, whole_sig, expectation_for(tiny_spec, 2, KV_LEN, length, torch.bfloat16,
                                                                 kv_read=16))
    assert violated and {v.contract for v in violated} == {"eager_attention"}
    assert any(f"reads {KV_LEN} keys" in v.detail for v in violated), violated


def test_ring_build_state_is_its_window(tiny_spec):
    """Under the ring, sliding layers' state is [1, kv_heads, window, d] (full layers keep KV_LEN),
    written by a select over the input ring, and their attention reads window + 1 keys in decode;
    judged as a linear build, the same graph fails the state shapes."""
    graph, sig, _ = _lowered(tiny_spec, 2, 1, kv_read=16, sliding_cache="ring")
    exp = expectation_for(tiny_spec, 2, KV_LEN, 1, torch.bfloat16, sliding_cache="ring", kv_read=16)
    window = tiny_spec.sliding_window
    assert exp.reads == {window + 1: sum(layer.is_sliding for layer in tiny_spec.layers),
                         16: sum(not layer.is_sliding for layer in tiny_spec.layers)}
    assert check_graph(graph.hlo, sig, exp) == []
    linear_exp = expectation_for(tiny_spec, 2, KV_LEN, 1, torch.bfloat16, kv_read=16)
    assert "kv_state_aliased" in {v.contract for v in check_graph(graph.hlo, sig, linear_exp)}


@pytest.mark.parametrize("tp", [1, 2])
def test_long_prompts_pass_on_the_xla_backend(long_ckpt, long_reference, tp):
    """The long prompts through chunked prefill and the ring on the xla backend: fp32, token for token."""
    settings = RunSettings(backend="xla", tp=tp, dtype=torch.float32, buckets=LONG_BUCKETS, kv_len=LONG_KV_LEN,
                           sliding_cache="ring")
    engine = build_engine(long_ckpt, settings, capture=True)
    result = check_port(long_ckpt, engine, long_reference["float32"], long_reference["bfloat16"], local=False,
                        fp32_engine=None)
    assert result.bf16.passed, result.failures()[:3]
