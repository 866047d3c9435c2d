"""CPU backend: the per-rank modules, one per rank with its own shard, and a real all-reduce.

Ranks run in threads of one process and meet at a barrier for each collective (the same
semantics as a torch.distributed group; tests/sharding also runs a gloo group of two processes).
Partial sums are reduced in fp32 in rank order, as NxD does with its default reduce_dtype: a wrong
grouping or a wrong shard gives wrong numbers here exactly as it would on the chip.
"""

from __future__ import annotations

import threading

import torch

from harness.graphs import kv_buckets, kv_read_length
from harness.model import Collectives, RankDecoder, RankLinears
from harness.sharding import merge_rank_caches, rank_state_dicts, ring_windows

COLLECTIVE_TIMEOUT_S = 600.0


class ThreadGroup:
    """A TP group of `world_size` threads exchanging tensors through shared slots."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=COLLECTIVE_TIMEOUT_S)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return gathered


class RankCollectives(Collectives):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank

    def all_reduce(self, x):
        parts = self.group.exchange(self.rank, x)
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total.to(x.dtype)

    def all_gather(self, x, dim):
        return torch.cat(self.group.exchange(self.rank, x), dim=dim)


class CpuBackend:
    """Runs the port on CPU at tensor parallel degree `tp`, in bf16 unless told otherwise."""

    name = "cpu"

    def __init__(self, checkpoint, tp: int = 2, dtype: torch.dtype = torch.bfloat16, max_len: int = 256,
                 buckets=None, sliding_cache: str = "linear", **_ignored):
        self.spec, self.tp, self.dtype, self.max_len = checkpoint.spec, tp, dtype, max_len
        self.sliding_cache, self.rings = sliding_cache, ring_windows(self.spec, sliding_cache, max_len)
        self.buckets = tuple(sorted(buckets)) if buckets else None  # the local verdict follows its prefill chunks
        self.kv_lengths = kv_buckets(self.buckets or (max_len,), max_len)
        self.group = ThreadGroup(tp)
        states = rank_state_dicts(checkpoint, tp, dtype)
        self.ranks = []
        for rank in range(tp):
            module = RankDecoder(self.spec, tp=tp, max_len=max_len, dtype=dtype,
                                 linears=RankLinears(RankCollectives(self.group, rank)), sliding_cache=sliding_cache)
            module.load_state_dict(states[rank], strict=True)
            module.eval()
            self.ranks.append(module)

    def reset(self) -> None:
        for module in self.ranks:
            module.reset_cache()

    def on_ranks(self, step) -> list:
        """Run `step(rank)` on every rank's thread at once, so the ranks' collectives meet; a
        failing rank aborts the barrier instead of leaving the others hanging."""
        results: list = [None] * self.tp
        errors: list[BaseException] = []

        def run(rank):
            try:
                with torch.no_grad():
                    results[rank] = step(rank)
            except BaseException as exc:
                errors.append(exc)
                self.group.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.group.barrier.reset()
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False):
        """Every rank runs the same step, reading the KV bucket a compiled graph of this call would
        read (graphs.kv_read_length); rank 0's (gathered, identical) outputs are returned."""
        read = kv_read_length(positions, self.kv_lengths)
        for module in self.ranks:
            module.set_kv_read(read)
        return self.on_ranks(lambda rank: self.ranks[rank](inputs_embeds, positions, capture=capture))[0]

    def kv_cache(self, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer's cache on one rank: [1, kv_heads, slots, d] (max_len slots, or a ring's window)."""
        cache = self.ranks[rank].layers[layer].self_attn.cache
        return cache.k, cache.v

    def read_cache(self, written: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's KV cache at the positions it holds after `written` writes, as the port stores
        it (keys after norm and rope, values after v_norm), merged over ranks, oldest position first
        (a ring unrolled): per layer (k, v), [kv_heads, held, d]."""
        return merge_rank_caches(self.spec, self.tp, self.kv_cache, written, self.rings)
