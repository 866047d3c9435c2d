"""The drafter on the CPU backend: one RankDrafter per rank on the backend's own thread group (its
collectives meet the target's ranks' barrier), reading each rank's target cache in place."""

from __future__ import annotations

import torch

from harness.backends.cpu import RankCollectives
from harness.port.drafter import RankDrafter, rank_drafter_state
from harness.port.model import RankLinears


class CpuDrafter:
    serves_slots = True  # step(slot=): a batched build's sequences draft from their own KV slot

    def __init__(self, backend, assistant):
        self.backend, self.spec = backend, assistant.spec
        self.ranks = []
        for rank in range(backend.tp):
            module = RankDrafter(self.spec, backend.tp, RankLinears(RankCollectives(backend.group, rank)), backend.dtype)
            module.load_state_dict(rank_drafter_state(assistant.weights, self.spec, backend.tp, rank, backend.dtype),
                                   strict=True)
            self.ranks.append(module.eval())

    def kv_for(self, rank: int, slot: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each drafter layer's keys and values: the rank's cache of the target's store layer of its
        type, the sequence in `slot`."""
        return [tuple(t[slot:slot + 1] for t in self.backend.kv_cache(layer.kv_source, rank)) for layer in self.spec.layers]

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, position: int, capture: bool = False, slot: int = 0):
        """One draft at `position` (keys [0, position) of the sequence in `slot`): (logits [vocab]
        fp32, state [1, 1, H], captures)."""
        pos = torch.tensor([[position]])
        out = self.backend.on_ranks(lambda rank: self.ranks[rank](embeds, hidden, pos, self.kv_for(rank, slot), capture))[0]
        logits, state, caps = out
        return logits[0, -1].float(), state, {k: v.float() for k, v in caps.items()}
