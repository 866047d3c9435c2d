"""The graph contracts on what torch-xla lowered: the real graphs meet all of them, and each
contract fails on its deliberate violation (softcap on device, SDPA, a cache updated in place or
re-allocated, a dynamic shape, extra cache slots written, weights of the wrong per-rank shape)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.hlo.contracts import CONTRACTS, check_graph, graph_stats
from harness.port import model
from harness.port.engine import softcap
from harness.port.graphs import TracedDecoder
from tests.xla.conftest import BUCKET, KV_LEN, lower_tiny

pytestmark = pytest.mark.xla


def contracts_violated(spec, tp=2, length=1, module_cls=None) -> dict[str, list[str]]:
    graph, sig, exp = lower_tiny(spec, tp, length, module_cls)
    out: dict[str, list[str]] = {}
    for v in check_graph(graph.hlo, sig, exp):
        out.setdefault(v.contract, []).append(v.detail)
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("length", [BUCKET, 1], ids=["prefill", "decode"])
def test_the_real_graphs_meet_every_contract(tiny_spec, tp, length):
    graph, sig, exp = lower_tiny(tiny_spec, tp, length)
    assert check_graph(graph.hlo, sig, exp) == []
    stats = graph_stats(graph.hlo, sig)
    layers = tiny_spec.num_layers
    # Row-parallel o_proj and down_proj all-reduce per layer; the vocab-parallel head gathers once.
    assert stats.collectives == ({} if tp == 1 else {"all-reduce": 2 * layers, "all-gather": 1})
    # a perf build: the last real row's raw bf16 logits, nothing else (all rows only in parity builds)
    assert stats.returned_bytes == 1 * tiny_spec.vocab_size * 2
    assert [r for r, n in sig.params if n == "last_index"] == ["input"]
    assert sum(1 for role, _ in sig.params if role == "state") == 2 * layers
    assert [r for r, n in sig.params if n == "positions"] == ["input"] and "s32[1," in graph.hlo


def test_softcap_put_back_on_the_device_fails(tiny_spec):
    class Capped(TracedDecoder):
        def forward(self, inputs_embeds, positions, last_index=None):
            return softcap(super().forward(inputs_embeds, positions, last_index), 30.0)

    violated = contracts_violated(tiny_spec, module_cls=Capped)
    assert list(violated) == ["softcap_off_device"], violated


def _sdpa_forward(self, x, cos, sin, positions, mask):
    b, s, _ = x.shape
    q = model.apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.q_heads, self.head_dim)), cos, sin).transpose(1, 2)
    k_raw = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
    v = k_raw if self.v_proj is None else self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
    k = model.apply_rope(self.k_norm(k_raw), cos, sin).transpose(1, 2)
    k_all, v_all = self.cache.update(positions, k, self.v_norm(v).transpose(1, 2))
    k_all, v_all = (t.repeat_interleave(self.groups, dim=1) for t in (k_all, v_all))
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=1.0)
    return self.o_proj(out.transpose(1, 2).reshape(b, s, self.q_heads * self.head_dim))


def test_sdpa_attention_fails(tiny_spec, monkeypatch):
    monkeypatch.setattr(model.Attention, "forward", _sdpa_forward)
    violated = contracts_violated(tiny_spec, length=BUCKET)
    assert list(violated) == ["eager_attention"], violated
    assert any("not the activation dtype bf16" in d for d in violated["eager_attention"])


def test_cache_updated_in_place_fails(tiny_spec, monkeypatch):
    def in_place(self, positions, k, v):
        self.k.index_copy_(2, positions[0], k)
        self.v.index_copy_(2, positions[0], v)
        return self.k, self.v

    monkeypatch.setattr(model.KVCache, "update", in_place)
    violated = contracts_violated(tiny_spec)
    assert "kv_state_aliased" in violated and set(violated) <= {"kv_state_aliased", "cache_writes_own_slots"}
    assert all("aliased to no output" in d for d in violated["kv_state_aliased"])


def test_cache_reallocated_fails(tiny_spec, monkeypatch):
    def reallocated(self, positions, k, v):
        self.k = torch.zeros_like(self.k).index_copy(2, positions[0], k)
        self.v = torch.zeros_like(self.v).index_copy(2, positions[0], v)
        return self.k, self.v

    monkeypatch.setattr(model.KVCache, "update", reallocated)
    violated = contracts_violated(tiny_spec)
    assert list(violated) == ["kv_state_aliased"], violated
    assert len(violated["kv_state_aliased"]) == 2 * tiny_spec.num_layers  # every k and v cache
    assert all("re-allocated" in d for d in violated["kv_state_aliased"])


def test_dynamic_shape_fails(tiny_spec):
    class Masked(TracedDecoder):
        def forward(self, inputs_embeds, positions, last_index=None):
            logits = super().forward(inputs_embeds, positions, last_index)
            return logits[:, positions[0, :logits.shape[1]] >= 0]  # boolean indexing: a data-dependent shape

    violated = contracts_violated(tiny_spec, length=BUCKET, module_cls=Masked)
    assert list(violated) == ["static_shapes"], violated


def test_decode_writing_two_slots_fails(tiny_spec, monkeypatch):
    def two_slots(self, positions, k, v):
        where = torch.cat([positions[0], (positions[0] + 1) % self.k.shape[2]])
        self.k = self.k.index_copy(2, where, torch.cat([k, k], 2))
        self.v = self.v.index_copy(2, where, torch.cat([v, v], 2))
        return self.k, self.v

    monkeypatch.setattr(model.KVCache, "update", two_slots)
    violated = contracts_violated(tiny_spec)
    assert list(violated) == ["cache_writes_own_slots"], violated
    assert all("writes 2 slot(s)" in d for d in violated["cache_writes_own_slots"])


def test_weights_of_the_wrong_per_rank_shape_fail(tiny_spec, monkeypatch):
    real_init = model.MLP.__init__

    def unsplit(self, spec, tp, linears, width=None):
        real_init(self, spec, 1, linears, width)  # every rank holds the whole MLP: not the plan's shards

    monkeypatch.setattr(model.MLP, "__init__", unsplit)
    violated = contracts_violated(tiny_spec)
    assert list(violated) == ["rank_weight_shapes"], violated
    assert len(violated["rank_weight_shapes"]) == 3 * tiny_spec.num_layers


def test_every_contract_has_a_violation_test():
    tested = {"softcap_off_device", "eager_attention", "kv_state_aliased", "static_shapes",
              "cache_writes_own_slots", "rank_weight_shapes"}
    assert set(CONTRACTS) == tested
    assert KV_LEN > BUCKET
