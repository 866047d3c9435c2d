"""The fused traced module of a compiled backend's drafter (harness/port/draft_graphs.py), eagerly on
CPU at TP 1: its forward routes by the inputs it is given (the target's graphs unchanged, a draft
step from the draft inputs), a draft step is the assistant's RankDrafter reading the target's
cache of each drafter layer's store layer in the graph's KV bucket, and it reassigns every KV
buffer (the state a compiled draft graph must carry) without changing a value. Through the NxD
double: tests/parity/test_neuron_drafter_double.py."""

from __future__ import annotations

import pytest
import torch

from harness.port import draft_graphs
from harness.port.drafter import DRAFTER_PREFIX, RankDrafter, rank_drafter_state
from harness.port.graphs import TracedDecoder, TracedFamilyDecoder, traced_class
from harness.port.model import KVCache, RankLinears
from harness.port.sharding import rank_state_dicts
from tests.unit.test_speculate import random_pair  # noqa: F401  (the fixture: the tiny 12B, an unfitted assistant)

PROMPT = [167, 112, 284, 335, 342]


def fused(random_pair, capture: bool = True):
    ckpt, assistant, _ = random_pair
    module = draft_graphs.drafting_class(ckpt.spec)(ckpt.spec, 1, 16, torch.float32, RankLinears(), with_captures=capture,
                                                    assistant=assistant.spec)
    drafter = {DRAFTER_PREFIX + k: v for k, v in rank_drafter_state(assistant.weights, assistant.spec, 1, 0,
                                                                     torch.float32).items()}
    module.load_state_dict({**rank_state_dicts(ckpt, 1, torch.float32)[0], **drafter}, strict=True)
    return module.eval(), ckpt, assistant


def test_the_fused_class_is_the_targets_traced_class_with_the_drafter(random_pair):
    ckpt = random_pair[0]
    cls = draft_graphs.drafting_class(ckpt.spec)
    assert issubclass(cls, traced_class(ckpt.spec)) and issubclass(cls, TracedDecoder)
    assert draft_graphs.TracedFamilyDraftingDecoder.__mro__[2] is TracedFamilyDecoder
    module, _, _ = fused(random_pair)
    assert not list(module.drafter.buffers())  # layer_scalar, token_ordering: weights set per run, never folded
    assert module.drafter.masked_embedding.token_ordering.dtype == torch.long


def test_a_draft_step_reads_the_targets_cache_and_carries_it(random_pair):
    module, ckpt, assistant = fused(random_pair)
    embeds = torch.randn(1, len(PROMPT), ckpt.spec.hidden_size)
    with torch.no_grad():
        target_only = traced_class(ckpt.spec)(ckpt.spec, 1, 16, torch.float32, RankLinears(), with_captures=True)
        target_only.load_state_dict(rank_state_dicts(ckpt, 1, torch.float32)[0])
        positions = torch.arange(len(PROMPT), dtype=torch.int32)[None]
        out, want = module(embeds, positions), target_only(embeds, positions)
        assert all(torch.equal(a, b) for a, b in zip(out, want))  # the target's graphs unchanged
        caches = {n: (m.k, m.v) for n, m in module.named_modules() if isinstance(m, KVCache)}
        e, h = torch.randn(1, 1, ckpt.spec.hidden_size), torch.randn(1, 1, ckpt.spec.hidden_size)
        module.draft_read = 8  # the trace of draft_kv8: slots [0, 8)
        logits, state, *caps = module(draft_embeds=e, draft_hidden=h, draft_position=torch.tensor([[len(PROMPT)]]))
        alone = RankDrafter(assistant.spec, 1, RankLinears(), torch.float32)
        alone.load_state_dict(rank_drafter_state(assistant.weights, assistant.spec, 1, 0, torch.float32))
        kv = [tuple(t[:, :, :8] for t in caches[f"layers.{layer.kv_source}.self_attn.cache"])
              for layer in assistant.spec.layers]
        ref_logits, ref_state, ref_caps = alone(e, h, torch.tensor([[len(PROMPT)]]), kv, capture=True)
    assert torch.equal(logits, ref_logits) and torch.equal(state, ref_state)
    assert module.draft_capture_names == list(ref_caps) and all(torch.equal(a, b) for a, b in zip(caps, ref_caps.values()))
    for name, cache in ((n, m) for n, m in module.named_modules() if isinstance(m, KVCache)):
        k, v = caches[name]
        assert cache.k is not k and cache.v is not v  # reassigned: the graph's state, not a folded constant
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v)  # and unchanged


@pytest.mark.parametrize("read", [None, 8])
def test_the_draft_step_reads_only_its_kv_bucket(random_pair, read):
    """Slots past the graph's KV bucket are never read: NaN there leaves a draft of bucket 8 finite."""
    module, ckpt, _ = fused(random_pair, capture=False)
    with torch.no_grad():
        module(torch.randn(1, len(PROMPT), ckpt.spec.hidden_size), torch.arange(len(PROMPT), dtype=torch.int32)[None])
        for cache in (m for m in module.modules() if isinstance(m, KVCache)):
            cache.k[:, :, 8:] = float("nan")
        module.draft_read = read
        logits, _ = module(draft_embeds=torch.randn(1, 1, ckpt.spec.hidden_size),
                           draft_hidden=torch.randn(1, 1, ckpt.spec.hidden_size), draft_position=torch.tensor([[5]]))
    assert bool(torch.isfinite(logits).all()) == (read == 8)
