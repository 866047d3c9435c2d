"""CPU backend: the per-rank modules, one per rank with its own shard, and a real all-reduce.

Ranks run in threads of one process and meet at a barrier for each collective (the same
semantics as a torch.distributed group; tests/sharding also runs a gloo group of two processes).
Partial sums are reduced in fp32 in rank order, as NxD does with its default reduce_dtype: a wrong
grouping or a wrong shard gives wrong numbers here exactly as it would on the chip.
"""

from __future__ import annotations

import threading

import torch

from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.port.blocks import rank_decoder
from harness.port.graphs import kv_buckets, kv_read_length
from harness.port.kv_slots import call_seq_ids
from harness.port.model import Collectives, RankLinears
from harness.port.quantized import QuantizedLinears, quantized
from harness.port.sharding import rank_state_dicts

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
    """Runs the port on CPU at the settings' tensor parallel degree and dtype. Every build returns
    captures when asked (the rank modules are plain torch), so `capture` changes nothing here."""

    name = "cpu"
    OPTIONS: dict = {}  # no backend options
    returns_captures, last_row_only, reads_cache, host_ranks, serves_batch = True, False, True, True, True
    drafts_on_device = False  # its drafter runs on the host (build_drafter)
    compiler_args = ()  # nothing is compiled ahead of time

    def __init__(self, checkpoint, settings: RunSettings, capture: bool = False):
        tp, dtype, max_len = settings.tp, settings.torch_dtype, settings.kv_len
        self.spec, self.tp, self.dtype, self.max_len = checkpoint.spec, tp, dtype, max_len
        self.sliding_cache = sliding_cache = settings.sliding_cache
        self.buckets = settings.buckets  # the local verdict follows the engine's prefill chunks
        self.kv_lengths = kv_buckets(self.buckets, max_len)
        self.group = ThreadGroup(tp)
        # --quantize: int8 projections and their scales (harness/port/quantized.py); else as always
        states = rank_state_dicts(checkpoint, tp, dtype, **quantized(getattr(settings, "quantize", None)))
        linears = RankLinears if getattr(settings, "quantize", None) is None else QuantizedLinears
        self.ranks = []
        for rank in range(tp):
            module = rank_decoder(self.spec, tp=tp, max_len=max_len, dtype=dtype, slots=settings.batch,
                                 linears=linears(RankCollectives(self.group, rank)), sliding_cache=sliding_cache)
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

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False,
                last: int | None = None, seq_ids: torch.Tensor | None = None, verify: bool = False):
        """Every rank runs the same step, reading the KV bucket a compiled graph of this call would
        read (graphs.kv_read_length); rank 0's (gathered, identical) outputs are returned:
        (logits, captures), captures empty unless asked for; only row `last` when it is given.
        `seq_ids` [b]: the KV slot of each row (harness.port.kv_slots); None: batch 1. `verify` changes
        nothing here (no compiled graphs: a verify call is a prefill chunk)."""
        if seq_ids is not None:  # checked here as the compiled backends check theirs (graphs.batch_graph_inputs)
            rows, slots = positions.shape[0], self.ranks[0].slots
            if rows > slots:
                raise HarnessInputError(f"{rows} rows in one call: the cache has {slots} slots (--batch {slots})")
            seq_ids = call_seq_ids(seq_ids, rows, slots)
        read = kv_read_length(positions, self.kv_lengths)
        for module in self.ranks:
            module.set_kv_read(read)
        out = self.on_ranks(lambda rank: self.ranks[rank](inputs_embeds, positions, capture=capture,
                                                          seq_ids=seq_ids))[0]
        logits, captures = out if capture else (out, {})
        return (logits if last is None else logits[:, last:last + 1]), captures

    def kv_cache(self, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer's cache on one rank: [seqs, kv_heads, slots, d] (max_len slots, or a
        ring's window; one per sequence: settings.batch)."""
        attn = self.ranks[rank].layers[layer].self_attn
        cache = getattr(attn, "cache", None) or attn.source_cache  # a KV-shared layer: its source's
        return cache.k, cache.v
