"""XLA backend: the device graphs of harness/port/graphs.py lowered by torch-xla on the CPU PJRT device
and executed, on the Neuron host's torch 2.9. With xla_env.py (the runtime, its collectives) and
xla_lower.py (one rank's graph lowered), the only modules of the project that import torch_xla.

torch-neuronx does not run eager code: it traces these same graphs through torch-xla into HLO for
neuronx-cc. Here torch-xla lowers them for XLA's CPU compiler instead, so what inf2 would trace is
executed (and its HLO inspected, harness/hlo/contracts.py) on any machine.

- Per-rank weights come from `harness.port.sharding.rank_state_dicts`; the KV cache is state carried
  between calls; positions enter as int32, as the Neuron backend feeds them.
- KV state follows NxD's rule: a buffer *reassigned* in forward is state (an output aliased to its
  input); a buffer updated in place is not (ModelBuilder does not support it), so it is dropped.
- TP=2 runs for real, with its collectives inside one program: XLA's SPMD mode over two CPU
  devices, each rank's graph inside a manual-sharding region (each device runs rank r's graph on
  rank r's weights), with an explicit all-reduce (in fp32: XLA's CPU all-reduce refuses bf16, and
  fp32 is NxD's reduce_dtype) and all-gather over the replica group of both ranks. Replicated
  per-thread execution and multi-process replicas stall in XLA's CPU rendezvous (docs/xla-lane.md).
"""

from __future__ import annotations

import os

import torch

from harness.backends.xla_env import (  # noqa: F401  (re-exported: the runtime and its collectives)
    CPU_DEVICES, INSTALL_COMMAND, TORCH_XLA_VERSION, XlaCollectives, xla_runtime)
from harness.backends.xla_lower import (  # noqa: F401  (re-exported: one rank's graph, lowered)
    LoweredGraph, bound, build_graph_module, graph_tensors, lower_graph, rank_step)
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.port.graphs import (GraphBuildError, batch_graph_inputs, constant_buffers, graph_inputs, graph_plan,
                                 graph_result, kv_buffer_names, kv_buckets, kv_read_length)
from harness.port.quantized import quantized
from harness.port.sharding import plan_model, rank_state_dicts


class XlaBackend:
    """Runs the port's device graphs through torch-xla on CPU at tensor parallel degree `tp` (same
    interface as CpuBackend and NeuronBackend, harness.backends.Backend): one prefill graph per
    bucket and the decode graph, a parity build (captures as extra outputs) when `capture=True`."""

    name = "xla"

    OPTIONS: dict = {}  # no backend options
    reads_cache, host_ranks, serves_batch, drafts_on_device = True, False, True, False
    compiler_args = ()  # XLA's CPU compiler runs with its defaults

    def __init__(self, checkpoint, settings: RunSettings, capture: bool = False):
        tp, dtype, max_len, buckets = settings.tp, settings.torch_dtype, settings.kv_len, settings.buckets
        self.rt = xla_runtime()  # before anything else: a missing torch-xla is reported first
        self.spec, self.tp, self.dtype, self.max_len = checkpoint.spec, tp, dtype, max_len
        self.sliding_cache = sliding_cache = settings.sliding_cache
        plan_model(self.spec, tp)  # a layout that cannot shard fails here
        if tp not in (1, self.rt.devices):
            raise HarnessInputError(f"the xla backend runs tp=1 or tp={self.rt.devices} (one XLA CPU device per "
                                    f"rank; CPU_NUM_DEVICES={os.environ.get('CPU_NUM_DEVICES')}), not tp={tp}")
        self.graphs = graph_plan(buckets, max_len, settings.speculate)  # with the verify graph (speculate > 0)
        self.kv_lengths = kv_buckets(buckets, max_len)
        self.capture = self.returns_captures = bool(capture)
        self.slots = settings.batch
        # a perf build returns only what greedy decode needs: the last real row (of each sequence)
        self.last_row_only = not self.capture
        self.module = build_graph_module(self.spec, tp, max_len, dtype, capture=self.capture,
                                         sliding_cache=sliding_cache, slots=self.slots, quantize=getattr(settings, "quantize", None))
        self.quantize = getattr(settings, "quantize", None)
        self.kv_names = kv_buffer_names(self.module)
        self.capture_names: list[str] | None = None
        xs = self.rt.xs
        import numpy as np

        self.mesh = xs.Mesh(np.arange(self.rt.devices), (self.rt.devices,), ("tp",))
        self.rank_rows = tp if tp > 1 else 1  # leading axis of the global tensors: one row per rank
        self.checkpoint = checkpoint
        states = rank_state_dicts(checkpoint, tp, dtype, **quantized(self.quantize))
        self._check_weights(states[0])
        constants = constant_buffers(self.module)
        self.weights = {name: self._global([s[name] for s in states]) for name in states[0]}
        self.weights.update({name: self._global([value] * self.rank_rows) for name, value in constants.items()})
        del states  # the device holds them now
        self.state: dict[str, torch.Tensor] = {}
        self.reset()

    # -- placement -----------------------------------------------------------------------------------
    def _spec(self, ndim: int, per_rank: bool) -> tuple:
        return (("tp" if per_rank and self.tp > 1 else None),) + (None,) * (ndim - 1)

    def _global(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """Rank tensors stacked on a leading axis, on the XLA devices, row r on device r."""
        tensor = torch.stack([t.contiguous() for t in per_rank]).to(self.rt.device)
        self.rt.xs.mark_sharding(tensor, self.mesh, self._spec(tensor.dim(), True))
        return tensor

    def _check_weights(self, state: dict[str, torch.Tensor]):
        expected = {n: tuple(t.shape) for n, t in self.module.state_dict().items()}
        got = {n: tuple(t.shape) for n, t in state.items()}
        if expected != got:
            wrong = sorted(n for n in set(expected) | set(got) if expected.get(n) != got.get(n))
            raise HarnessInputError(f"per-rank weights do not fit the graph module: {wrong[:8]} "
                                    f"(graph {[expected.get(n) for n in wrong[:3]]}, shards {[got.get(n) for n in wrong[:3]]})")

    def _local(self, tensor: torch.Tensor, per_rank: bool) -> torch.Tensor:
        """Inside the manual region: this device's rank row (or the whole replicated tensor)."""
        local = self.rt.xs.enable_manual_sharding(tensor, self._spec(tensor.dim(), per_rank), mesh=self.mesh)
        return local.global_tensor[0] if per_rank else local.global_tensor

    def _to_global(self, local: torch.Tensor, per_rank: bool = True) -> torch.Tensor:
        """Leave the manual region: rank rows stacked (state), or, for outputs every rank computes
        identically (gathered logits, all-reduced hidden states), rank 0's taken as replicated
        (as CpuBackend returns rank 0's; copying it to the host needs no gather program)."""
        full = (self.rank_rows if per_rank else 1, *local.shape)
        return self.rt.xs.disable_manual_sharding(local[None], self._spec(len(full), per_rank), full,
                                                  mesh=self.mesh).global_tensor

    # -- running -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the KV cache of every rank."""
        self.state = {n: self._global([torch.zeros_like(self.module.get_buffer(n))] * self.rank_rows)
                      for n in self.kv_names}

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False,
                last: int | None = None, seq_ids: torch.Tensor | None = None, verify: bool = False):
        """inputs_embeds [1, s, hidden], positions [1, s] -> raw logits [1, s, vocab] (with captures on a
        parity build). s must be a bucket of the plan or 1 (decode), as on the device. A perf build
        returns only row `last` (the last real position; 0 for decode): [1, 1, vocab]. A batched
        build (settings.batch > 1) takes [b, s] rows and `seq_ids` [b] (harness/port/kv_slots.py).
        `verify`: the verify graph (k+1 rows, every row's logits; graphs.graph_result)."""
        if self.slots > 1:
            if capture and not self.capture:
                raise HarnessInputError("this is a perf build (no capture outputs in its graphs); build the "
                                        "backend with capture=True for a parity build to capture activations")
            graph_in = batch_graph_inputs(self.spec, self.graphs, inputs_embeds, positions, seq_ids=seq_ids,
                                          dtype=self.dtype, slots=self.slots, last_row_only=self.last_row_only,
                                          verify=verify)
        else:
            _, graph_in = graph_inputs(self.spec, self.graphs, inputs_embeds, positions, self.dtype, capture=capture,
                                       parity_build=self.capture, last_row_only=self.last_row_only, last=last,
                                       verify=verify)
        self.module.set_kv_read(kv_read_length(positions, self.kv_lengths))  # one graph per KV bucket
        outputs = self._step(*graph_in)
        if self.capture and self.capture_names is None:
            self.capture_names = list(self.module.capture_names)
        embeds = graph_in[0][..., :self.spec.hidden_size]  # without the family's per-layer rows
        return graph_result(outputs, self.capture_names if self.capture else None, embeds, capture,
                            self.last_row_only, last=last, verify=verify)

    def _step(self, *graph_inputs) -> list[torch.Tensor]:
        """Every rank's graph in one SPMD program (collectives in-graph), executed; outputs of rank 0."""
        device = self.rt.device
        inputs = [self._local(t.contiguous().to(device), per_rank=False) for t in graph_inputs]
        tensors = {n: self._local(t, per_rank=True) for n, t in {**self.weights, **self.state}.items()}
        outputs, new_state = rank_step(self.module, tensors, self.kv_names, *inputs)
        missing = sorted(set(self.kv_names) - set(new_state))
        if missing:
            raise GraphBuildError(f"KV cache buffers {missing[:4]} were not reassigned in forward: they would not "
                                  "persist between calls as device state (NxD makes state only of reassigned buffers)")
        results = [self._to_global(o, per_rank=False) for o in outputs]
        self.state = {n: self._to_global(new_state[n]) for n in self.kv_names}
        self.rt.torch_xla.sync()
        return [r.cpu()[0] for r in results]

    def kv_cache(self, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer's cache on one rank, copied to the host: [1, kv_heads, max_len, d]."""
        keys = [f"layers.{layer}.self_attn.cache.{b}" for b in ("k", "v")]
        if self.tp == 1:
            return tuple(self.state[k].cpu()[0] for k in keys)
        # rank r's row from device r alone: a .cpu() of the sharded tensor compiles a gather program
        # per call (a speculative parity run reads the cache every round)
        shards = self.rt.torch_xla._XLAC._get_local_shards([self.state[k] for k in keys])
        return tuple(sorted(s, key=lambda shard: int(shard[1].rsplit(":", 1)[1]))[rank][0][0] for s in shards)

    def lower_graphs(self, rank: int = 0) -> dict[str, LoweredGraph]:
        """Every graph of the plan, lowered for one rank on that rank's weights (not executed)."""
        tensors, roles = graph_tensors(self.module, rank_state_dicts(self.checkpoint, self.tp, self.dtype, **quantized(self.quantize))[rank])
        return {tag: lower_graph(self.module, tensors, roles, tag, length, rank=rank)
                for tag, length in self.graphs.items()}
