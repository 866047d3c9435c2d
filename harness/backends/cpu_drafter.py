"""The drafter on the CPU backend: one RankDrafter per rank on the backend's own thread group (its
collectives meet the target's ranks' barrier), reading each rank's target cache in place."""

from __future__ import annotations

import torch

from harness.backends.cpu import RankCollectives
from harness.port.drafter import RankDrafter, rank_drafter_state
from harness.port.model import RankLinears


class CpuDrafter:
    def __init__(self, backend, assistant):
        self.backend, self.spec = backend, assistant.spec
        self.ranks = []
        for rank in range(backend.tp):
            module = RankDrafter(self.spec, backend.tp, RankLinears(RankCollectives(backend.group, rank)), backend.dtype)
            module.load_state_dict(rank_drafter_state(assistant.weights, self.spec, backend.tp, rank, backend.dtype),
                                   strict=True)
            self.ranks.append(module.eval())

    def kv_for(self, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each drafter layer's keys and values: the rank's cache of the target's store layer of its type."""
        return [self.backend.kv_cache(layer.kv_source, rank) for layer in self.spec.layers]

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, position: int, capture: bool = False):
        """One draft at `position` (keys [0, position)): (logits [vocab] fp32, state [1, 1, H], captures)."""
        pos = torch.tensor([[position]])
        out = self.backend.on_ranks(lambda rank: self.ranks[rank](embeds, hidden, pos, self.kv_for(rank), capture))[0]
        logits, state, caps = out
        return logits[0, -1].float(), state, {k: v.float() for k, v in caps.items()}
