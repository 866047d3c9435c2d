"""The draft graphs of a compiled backend whose drafter runs on the device (docs/speculative.md).

The drafter reads the target's KV cache, and on a compiled backend that cache is device state of
the target's compiled model: a graph can read it only as a graph of that same model. So the traced
module is the target's (`graphs.traced_class`) holding the assistant's `RankDrafter` as a submodule
(`drafter.*` weights beside the target's), and its forward routes by which inputs it is given, as
NxD routes a call by the names and shapes of the provided arguments: `inputs_embeds`, `positions`
(and a perf build's `last_index`) run the target's graphs as before; `draft_embeds`,
`draft_hidden`, `draft_position` run one draft step (harness/port/drafter.py) reading the target's
cache of each drafter layer's store layer, in the slots of the graph's KV bucket (`draft_read`,
fixed per trace as the target's `set_kv_read` is). NxD-Inference's fused speculation
(`NeuronFusedSpecModel`, tagged `fused_speculation_model`) likewise traces its draft and target
models as submodules of one module; it runs the k draft steps and the verify in one token-generation
graph, where this port runs one draft step per call (the judge captures every step, and the verify
is the target's own graph).

A batched build (a KV cache of several sequences' slots, harness/port/kv_slots.py) holds the same
drafter in `TracedBatchDecoder`'s module: the target's graphs take `seq_ids` as before, and a draft
graph also takes `draft_seq` ([1] int32, the drafting sequence's KV slot), an input as the
position is, so one draft graph per KV bucket serves every slot. It reads that slot's first
positions only (kv_slots.read_slot) and carries only that slot's row at the drafting position
(kv_slots.carry_slot). Each sequence drafts on its own (the decode loop drafts per sequence, as
the cpu and xla drafters do); the verify of every sequence's drafts is one batched verify call.

A draft graph reads the cache without writing it. A buffer a traced graph reads but never
reassigns need not become device state: the tracer may fold it into the graph as a constant at
its trace-time value (zeros), and the drafter would then read zeros forever, its drafts never
accepted while the target's output stays right. So the draft graph reassigns every KV buffer out
of place (`carry_kv`: the slot at the drafting position rewritten with itself, a no-op on the
values), which makes the cache the graph's aliased state like every other graph's.

This module imports no SDK; the Neuron backend builds it with NxD's layers
(harness/backends/neuron_drafter.py)."""

from __future__ import annotations

import torch
from torch import nn

from harness.port.drafter import RankDrafter
from harness.port.graphs import (POSITION_DTYPE, TracedBatchDecoder, TracedDecoder, TracedFamilyBatchDecoder,
                                 TracedFamilyDecoder, traced_class)
from harness.port.kv_cache import KVCache
from harness.port.kv_slots import carry_slot, read_slot

DRAFT_TAG = "draft"
DRAFT_INPUTS = ("draft_embeds", "draft_hidden", "draft_position")


def weights_not_buffers(module: nn.Module) -> None:
    """Every buffer of `module` (the drafter's layer_scalar and token_ordering) made a frozen
    parameter of the same name: a compiled graph reads parameters as weights set per run, while a
    buffer it never reassigns may be folded in at its construction-time value."""
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                del sub._buffers[name]
                sub.register_parameter(name, nn.Parameter(buf, requires_grad=False))


class DraftingDecoder:
    """Mixed into a traced decoder class: the target's graphs and the drafter's in one module
    (one sequence's cache; BatchDraftingDecoder: a cache of several slots)."""

    def __init__(self, spec, tp: int, max_len: int, dtype: torch.dtype, linears, *, assistant, **options):
        super().__init__(spec, tp, max_len, dtype, linears, **options)
        if self.slots != 1 and not isinstance(self, BatchDraftingDecoder):
            raise ValueError("a cache of several slots drafts through BatchDraftingDecoder (drafting_class(batched=True))")
        self.drafter = RankDrafter(assistant, tp, linears, dtype)
        weights_not_buffers(self.drafter)
        self.draft_read: int | None = None  # the KV bucket the draft graph being traced reads
        self.draft_capture_names: list[str] = []

    def forward(self, inputs_embeds=None, positions=None, last_index=None, draft_embeds=None, draft_hidden=None,
                draft_position=None):
        if draft_embeds is None:
            return super().forward(inputs_embeds, positions, last_index)
        return self.draft(draft_embeds, draft_hidden, draft_position)

    def draft(self, embeds, hidden, position, seq=None):
        """One draft step at `position` [1, 1] (keys [0, position) of the sequence in KV slot `seq`
        [1], or of the one sequence): (logits [1, 1, vocab], the post-projected state [1, 1, H])
        and, on a parity build, the drafter's captures."""
        position = position.to(torch.long)
        on = () if seq is None else (seq.to(torch.long).reshape(1),)
        kv = [self.target_kv(layer.kv_source, *on) for layer in self.drafter.aspec.layers]  # read, then carry:
        self.carry_kv(position.reshape(1), *on)  # the reads take the input cache, not the carried copy
        logits, state, caps = self.drafter(embeds, hidden, position, kv, capture=self.with_captures)
        if not self.with_captures:
            return logits, state
        self.draft_capture_names = list(caps)
        return (logits, state, *caps.values())

    def carry_kv(self, slot: torch.Tensor, seq: torch.Tensor | None = None) -> None:
        """Every KV buffer reassigned out of place, its slot `slot` (the drafting position) rewritten
        with itself (module doc); with `seq`, only that sequence's row there (kv_slots.carry_slot)."""
        for cache in (m for m in self.modules() if isinstance(m, KVCache)):
            if seq is not None:
                cache.k, cache.v = (carry_slot(t, seq, slot.reshape(1, 1)) for t in (cache.k, cache.v))
                continue
            cache.k = cache.k.index_copy(2, slot, cache.k.index_select(2, slot))
            cache.v = cache.v.index_copy(2, slot, cache.v.index_select(2, slot))

    def target_kv(self, layer: int, seq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of target layer `layer`'s cache in the graph's KV bucket: [1, kv_heads, slots, d]
        (with `seq`, of the sequence in that KV slot: kv_slots.read_slot)."""
        cache = self.get_submodule(f"layers.{layer}.self_attn.cache")
        n = self.draft_read or cache.k.shape[2]
        if seq is not None:
            return read_slot(cache.k, seq, n), read_slot(cache.v, seq, n)
        return cache.k[:, :, :n], cache.v[:, :, :n]


class BatchDraftingDecoder(DraftingDecoder):
    """Mixed into a batched traced decoder (TracedBatchDecoder): its graphs as before (`seq_ids`,
    a perf build's `last_index`), and a draft step of the sequence in KV slot `draft_seq` [1]."""

    def forward(self, inputs_embeds=None, positions=None, seq_ids=None, last_index=None, draft_embeds=None,
                draft_hidden=None, draft_position=None, draft_seq=None):
        if draft_embeds is None:
            return TracedBatchDecoder.forward(self, inputs_embeds, positions, seq_ids, last_index)
        return self.draft(draft_embeds, draft_hidden, draft_position, draft_seq)


class TracedDraftingDecoder(DraftingDecoder, TracedDecoder):
    """The 12B's traced decoder with the drafter."""


class TracedFamilyDraftingDecoder(DraftingDecoder, TracedFamilyDecoder):
    """The gemma4 family's traced decoder with the drafter."""


class TracedBatchDraftingDecoder(BatchDraftingDecoder, TracedBatchDecoder):
    """The 12B's batched traced decoder with the drafter."""


class TracedFamilyBatchDraftingDecoder(BatchDraftingDecoder, TracedFamilyBatchDecoder):
    """The gemma4 family's batched traced decoder with the drafter."""


def drafting_class(spec, batched: bool = False) -> type:
    """The traced module class of a target with its drafter (graphs.traced_class's; `batched`: a
    build of several KV slots, its draft graphs taking `draft_seq`)."""
    family = traced_class(spec) is TracedFamilyDecoder
    if batched:
        return TracedFamilyBatchDraftingDecoder if family else TracedBatchDraftingDecoder
    return TracedFamilyDraftingDecoder if family else TracedDraftingDecoder


def draft_example_inputs(hidden: int, dtype: torch.dtype, batched: bool = False) -> dict[str, torch.Tensor]:
    """The keyword inputs a draft graph is traced with (and called with: NxD routes by their names);
    a batched build's also `draft_seq` [1], the drafting sequence's KV slot."""
    inputs = {"draft_embeds": torch.zeros(1, 1, hidden, dtype=dtype),
              "draft_hidden": torch.zeros(1, 1, hidden, dtype=dtype),
              "draft_position": torch.zeros(1, 1, dtype=POSITION_DTYPE)}
    return {**inputs, "draft_seq": torch.zeros(1, dtype=POSITION_DTYPE)} if batched else inputs
