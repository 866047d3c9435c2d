"""The fused traced module of a compiled backend's drafter (harness/port/draft_graphs.py), eagerly on
CPU at TP 1 with random weights (no checkpoint): its forward routes by the inputs it is given (the
target's graphs unchanged, a draft step from the draft inputs), a draft step is the assistant's
RankDrafter reading the target's cache of each drafter layer's store layer in the graph's KV
bucket, and it reassigns every KV buffer (the state a compiled draft graph must carry) without
changing a value. On the unified 12B-like target and a gemma4 family one. Through the NxD double:
tests/parity/test_neuron_drafter_double.py."""

from __future__ import annotations

import json

import pytest
import torch

from harness import FIXTURES_DIR
from harness.inputs.assistant_spec import assistant_spec_from_dict
from harness.inputs.spec import load_spec
from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY
from harness.port import draft_graphs
from harness.port.drafter import DRAFTER_PREFIX, RankDrafter
from harness.port.graphs import traced_class
from harness.port.kv_cache import KVCache
from harness.port.model import RankLinears

PAIRS = {"12b": (TINY_CONFIG, "gemma-4-tiny-assistant.json"), "31b": (TINY_FAMILY["31b"], "gemma-4-tiny-31b-assistant.json")}
N = 5


def fused(name: str, capture: bool = True):
    target, assistant = PAIRS[name]
    spec = load_spec(target)
    aspec = assistant_spec_from_dict(json.loads((FIXTURES_DIR / "configs" / "tiny" / assistant).read_text()), spec)
    torch.manual_seed(0)
    module = draft_graphs.drafting_class(spec)(spec, 1, 16, torch.float32, RankLinears(), with_captures=capture,
                                               assistant=aspec)
    return module.eval(), spec, aspec


def caches(module) -> dict[str, KVCache]:
    return {n: m for n, m in module.named_modules() if isinstance(m, KVCache)}


@pytest.mark.parametrize("name", ["12b", "31b"])
def test_a_draft_step_reads_the_targets_cache_and_carries_it(name):
    module, spec, aspec = fused(name)
    assert isinstance(module, traced_class(spec))
    assert not list(module.drafter.buffers())  # layer_scalar, token_ordering: weights set per run, never folded
    target_only = traced_class(spec)(spec, 1, 16, torch.float32, RankLinears(), with_captures=True)
    target_only.load_state_dict({k: v for k, v in module.state_dict().items() if not k.startswith(DRAFTER_PREFIX)})
    alone = RankDrafter(aspec, 1, RankLinears(), torch.float32)
    alone.load_state_dict({k[len(DRAFTER_PREFIX):]: v for k, v in module.state_dict().items() if k.startswith(DRAFTER_PREFIX)})
    embeds = torch.randn(1, N, spec.hidden_size + spec.num_layers * spec.per_layer_input_size)
    positions = torch.arange(N, dtype=torch.int32)[None]
    e, h, p = torch.randn(1, 1, spec.hidden_size), torch.randn(1, 1, spec.hidden_size), torch.tensor([[N]])
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(module(embeds, positions), target_only(embeds, positions)))
        before = {n: (c.k, c.v) for n, c in caches(module).items()}
        module.draft_read = 8  # the trace of draft_kv8: slots [0, 8)
        logits, state, *caps = module(draft_embeds=e, draft_hidden=h, draft_position=p)
        kv = [tuple(t[:, :, :8] for t in before[f"layers.{layer.kv_source}.self_attn.cache"]) for layer in aspec.layers]
        want_logits, want_state, want_caps = alone(e, h, p, kv, capture=True)
    assert torch.equal(logits, want_logits) and torch.equal(state, want_state)
    assert module.draft_capture_names == list(want_caps) and all(torch.equal(a, b) for a, b in zip(caps, want_caps.values()))
    for name, cache in caches(module).items():
        k, v = before[name]
        assert cache.k is not k and cache.v is not v  # reassigned: the graph's state, not a folded constant
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v)  # and unchanged


@pytest.mark.parametrize("read", [None, 8])
def test_the_draft_step_reads_only_its_kv_bucket(read):
    """Slots past the graph's KV bucket are never read: NaN there leaves a draft of bucket 8 finite."""
    module, spec, _ = fused("12b", capture=False)
    with torch.no_grad():
        module(torch.randn(1, N, spec.hidden_size), torch.arange(N, dtype=torch.int32)[None])
        for cache in caches(module).values():
            cache.k[:, :, 8:] = float("nan")
        module.draft_read = read
        logits, _ = module(draft_embeds=torch.randn(1, 1, spec.hidden_size), draft_hidden=torch.randn(1, 1, spec.hidden_size),
                           draft_position=torch.tensor([[N]]))
    assert bool(torch.isfinite(logits).all()) == (read == 8)


@pytest.mark.parametrize("name", ["12b", "31b"])
def test_a_batched_draft_step_reads_and_carries_only_its_own_slot(name):
    """The batched fused module (a cache of 3 slots, draft_graphs.BatchDraftingDecoder): its target
    graphs are TracedBatchDecoder's; a draft step of `draft_seq` s is the RankDrafter on slot s's keys
    alone (NaN in every other slot and past the KV bucket leaves it finite, and another slot drafts
    another step), and it reassigns every KV buffer without changing a value."""
    from harness.port.graphs import TracedBatchDecoder  # the family's too (traced_class, batched)

    target, assistant = PAIRS[name]
    spec = load_spec(target)
    aspec = assistant_spec_from_dict(json.loads((FIXTURES_DIR / "configs" / "tiny" / assistant).read_text()), spec)
    torch.manual_seed(0)
    module = draft_graphs.drafting_class(spec, batched=True)(spec, 1, 16, torch.float32, RankLinears(), slots=3,
                                                             assistant=aspec).eval()
    assert isinstance(module, TracedBatchDecoder) and isinstance(module, traced_class(spec, batched=True))
    alone = RankDrafter(aspec, 1, RankLinears(), torch.float32)
    alone.load_state_dict({k[len(DRAFTER_PREFIX):]: v for k, v in module.state_dict().items() if k.startswith(DRAFTER_PREFIX)})
    e, h, p = torch.randn(1, 1, spec.hidden_size), torch.randn(1, 1, spec.hidden_size), torch.tensor([[N]], dtype=torch.int32)
    with torch.no_grad():
        width = spec.hidden_size + spec.num_layers * spec.per_layer_input_size
        module(torch.randn(3, N, width), torch.arange(N, dtype=torch.int32).expand(3, -1).contiguous(),
               torch.tensor([2, 0, 1], dtype=torch.int32))  # three prompts, one per slot
        healthy = {n: (c.k.clone(), c.v.clone()) for n, c in caches(module).items()}
        for cache in caches(module).values():
            cache.k[[0, 2]], cache.v[[0, 2]] = float("nan"), float("nan")  # every slot but 1
            cache.k[:, :, 8:], cache.v[:, :, 8:] = float("nan"), float("nan")  # and past the bucket
        before = {n: (c.k, c.v) for n, c in caches(module).items()}
        module.draft_read = 8
        logits, state = module(draft_embeds=e, draft_hidden=h, draft_position=p,
                               draft_seq=torch.tensor([1], dtype=torch.int32))
        kv = [tuple(t[1:2, :, :8] for t in healthy[f"layers.{layer.kv_source}.self_attn.cache"]) for layer in aspec.layers]
        want_logits, want_state, _ = alone(e, h, p, kv)
        for name, cache in caches(module).items():
            k, v = before[name]
            assert cache.k is not k and cache.v is not v  # reassigned: the draft graph's state
            assert torch.equal(cache.k.nan_to_num(), k.nan_to_num()) and torch.equal(cache.v.nan_to_num(), v.nan_to_num())
            cache.k, cache.v = healthy[name]  # the healthy cache back: slot 2 drafts another step
        other, _ = module(draft_embeds=e, draft_hidden=h, draft_position=p, draft_seq=torch.tensor([2], dtype=torch.int32))
    assert torch.isfinite(logits).all() and torch.equal(logits, want_logits) and torch.equal(state, want_state)
    assert not torch.equal(other, logits)
