"""The drafter on the Neuron backend: draft graphs of the target's own NxDModel (docs/speculative.md).

A run with an assistant (RunSettings.assistant) builds the fused traced module of
harness/port/draft_graphs.py with NxD's layers: the target's graphs as before, plus one draft graph
per KV bucket, tagged `draft_kv<bucket>` and traced with the keyword inputs `draft_embeds`,
`draft_hidden`, `draft_position` (ModelBuilder v2 takes a different set of provided arguments per
tag, all parameters of the one forward defaulting to None; NxDModel routes a call by the provided
names and shapes, neuronx-distributed trace/nxd_model/utils.py generate_route_key_from_provided_args).
The drafter's weights are the module's `drafter.*` parameters, set with the target's by
NxDModel.set_weights; the draft graphs read the target's KV cache as the aliased state every graph
shares (draft_graphs.carry_kv; the backend refuses a graph that does not carry it,
neuron_layers.graph_io). `NeuronDrafter` is what `harness.backends.build_drafter` returns: one
draft step per call, on the graph of the smallest KV bucket holding the drafting position. A build
of several KV slots (--batch N) holds the batched fused module (draft_graphs.BatchDraftingDecoder):
its draft graphs take `draft_seq` too, the drafting sequence's slot, so every sequence of a batch
drafts from its own slot (`serves_slots`) through the same one graph per KV bucket, and the batched
verify graph (at every batch bucket) checks all of their drafts in one call.
The artifact cache key gains the assistant's spec hash, k and this source's hash (`drafter_key`),
so a target-only entry is never reused for a fused build, nor the other way round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from harness.backends.neuron_cache import DRAFTER_SOURCE_FILES, model_source_hash
from harness.base.errors import HarnessInputError
from harness.port.draft_graphs import DRAFT_TAG, draft_example_inputs
from harness.port.drafter import DRAFTER_PREFIX, rank_drafter_state
from harness.port.graphs import POSITION_DTYPE, kv_read_length


def draft_tags(kv_lengths) -> dict[str, tuple[int, int]]:
    """ModelBuilder tag -> (sequence length 1, KV bucket) of every draft graph: one per KV bucket."""
    return {f"{DRAFT_TAG}_kv{int(kv)}": (1, int(kv)) for kv in sorted(kv_lengths)}


def assistant_spec_hash(aspec) -> str:
    """sha256 of the assistant's resolved spec (everything the draft graphs bake in; not its path)."""
    fields = {k: v for k, v in dataclasses.asdict(aspec).items() if k != "source"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def drafter_key(aspec, k: int, tags: dict) -> dict:
    """The drafter's part of the artifact cache key."""
    return {"assistant_spec": assistant_spec_hash(aspec), "speculate": int(k),
            "draft_graphs": {t: list(v) for t, v in sorted(tags.items())},
            "source": model_source_hash(DRAFTER_SOURCE_FILES)}


def open_assistant(settings, spec):
    """The run's AssistantCheckpoint (settings.assistant), or None (a batched build drafts per slot)."""
    if settings.assistant is None:
        return None
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint

    return AssistantCheckpoint.open(settings.assistant, spec)


def trace_draft_graphs(builder, module, tags: dict, hidden: int, dtype: torch.dtype, batched: bool = False) -> None:
    """builder.trace of each draft graph, the module told its KV bucket first (the trace bakes it in);
    `batched`: a build of several KV slots, its draft graphs taking the drafting slot (`draft_seq`)."""
    for tag, (_, kv) in tags.items():
        module.draft_read = kv
        builder.trace(kwargs=draft_example_inputs(hidden, dtype, batched=batched), tag=tag)
    module.draft_read = None


def drafter_rank_weights(assistant, tp: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Each rank's drafter weights under the fused module's names (`drafter.*`)."""
    return [{DRAFTER_PREFIX + name: w for name, w in rank_drafter_state(assistant.weights, assistant.spec, tp, rank,
                                                                           dtype).items()} for rank in range(tp)]


class NeuronDrafter:
    """The drafter of a NeuronBackend built with an assistant (the interface of cpu_drafter.CpuDrafter)."""

    serves_slots = True  # step(slot=): a batched build's sequences draft from their own KV slot (draft_seq)

    def __init__(self, backend, assistant, capture_names: list[str] | None):
        self.backend, self.spec, self.capture_names = backend, assistant.spec, capture_names
        self.last_tag: str | None = None

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, position: int, capture: bool = False, slot: int = 0):
        """One draft at `position` (keys [0, position) of the sequence in KV slot `slot`): (logits
        [vocab] fp32, state [1, 1, H], captures)."""
        be = self.backend
        if capture and not be.capture:
            raise HarnessInputError("this is a perf build (no capture outputs in its draft graphs); build the "
                                    "backend with capture=True for a parity build to capture the drafter's points")
        if not 0 <= int(slot) < be.slots:
            raise HarnessInputError(f"draft from KV slot {slot}: the build has slots 0..{be.slots - 1} (--batch {be.slots})")
        pos = torch.tensor([[int(position)]], dtype=POSITION_DTYPE)
        # a batched build's draft graphs take the slot (draft_seq, an input: one graph serves every slot)
        seq = {"draft_seq": torch.tensor([int(slot)], dtype=POSITION_DTYPE)} if be.slots > 1 else {}
        self.last_tag = f"{DRAFT_TAG}_kv{kv_read_length(pos, be.kv_lengths)}"
        out = be.nxd_model(draft_embeds=embeds.to(be.dtype).contiguous(), draft_hidden=hidden.to(be.dtype).contiguous(),
                           draft_position=pos, **seq, model_name=self.last_tag)
        logits, state, *caps = out
        captures = dict(zip(self.capture_names or (), caps)) if capture else {}
        return logits[0, -1].float(), state, {k: v.float() for k, v in captures.items()}
