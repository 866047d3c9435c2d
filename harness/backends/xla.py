"""XLA backend: the device graphs of harness/port/graphs.py lowered by torch-xla on the CPU PJRT device
and executed, on the Neuron host's torch 2.9. The only module of the project that imports torch_xla.

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

import contextlib
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from harness.base.errors import HarnessInputError
from harness.port.graphs import (GraphBuildError, TracedBatchDecoder, batch_example_inputs, batch_graph_inputs,
                                 constant_buffers, example_inputs, graph_inputs, graph_plan, graph_result, input_width,
                                 is_verify_tag, kv_buffer_names, kv_buckets, kv_read_length, traced_class)
from harness.base.settings import RunSettings
from harness.port.model import Collectives, RankLinears
from harness.port.quantized import QuantizedLinears, quantized
from harness.port.sharding import plan_model, rank_state_dicts

TORCH_XLA_VERSION = "2.9.0"  # keep in step with pyproject's `xla` extra
INSTALL_COMMAND = (f"pip install torch=={TORCH_XLA_VERSION} torch-xla=={TORCH_XLA_VERSION} "
                   "(or, in a checkout: pip install torch==2.9.0 -e '.[xla]')")
CPU_DEVICES = 2  # XLA CPU devices in the process: one per rank at TP=2


@functools.lru_cache(maxsize=None)
def xla_runtime() -> SimpleNamespace:
    """Import torch_xla on the CPU PJRT device with two devices in SPMD mode, once per process.

    A missing or mismatched torch-xla is bad input (exit 2) with the install command."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", str(CPU_DEVICES))
    if os.environ["PJRT_DEVICE"] != "CPU":
        raise HarnessInputError(f"the xla backend runs XLA on CPU but PJRT_DEVICE={os.environ['PJRT_DEVICE']}; "
                                "unset it or set PJRT_DEVICE=CPU")
    try:
        import torch_xla
        import torch_xla.debug.metrics as metrics
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except Exception as exc:  # ImportError, or an ABI mismatch with this torch (OSError, undefined symbol)
        raise HarnessInputError(
            f"the xla backend needs torch-xla {TORCH_XLA_VERSION} with torch {TORCH_XLA_VERSION} (the Neuron "
            f"host's torch); this environment has torch {torch.__version__} and importing torch_xla failed "
            f"({exc!r}). Install them in a separate environment: {INSTALL_COMMAND}") from exc
    _no_jax_bridge()
    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    return SimpleNamespace(torch_xla=torch_xla, xs=xs, xr=xr, metrics=metrics, device=torch_xla.device(),
                           devices=devices)


def _no_jax_bridge() -> None:
    """torch-xla 2.9's mark_sharding tries `import torchax` and `import jax` on every call (its JAX
    bridge, torch_xla/_internal/jax_workarounds.py). Without jax that import fails, is not cached,
    and is retried for each of the ~180 tensors a step places: a third of a family check's time in
    the XLA lane. torchax needs jax, so without jax both imports can only fail: record that once."""
    if importlib.util.find_spec("jax") is None:
        sys.modules.setdefault("jax", None)
        sys.modules.setdefault("torchax", None)


class XlaCollectives(Collectives):
    """In-graph collectives of one rank's graph over the replica group of all `tp` ranks."""

    def __init__(self, tp: int):
        self.tp, self.groups = tp, [list(range(tp))]

    def all_reduce(self, x):
        if self.tp == 1:
            return x
        xlac = xla_runtime().torch_xla._XLAC
        # fp32 partial sums (XLA's CPU all-reduce refuses bf16; NxD's reduce_dtype), cast back.
        return xlac._xla_spmd_all_reduce("sum", x.float(), 1.0, self.groups).to(x.dtype)

    def all_gather(self, x, dim):
        if self.tp == 1:
            return x
        xlac = xla_runtime().torch_xla._XLAC
        # (input, dim, shard_count, groups, pin_layout, channel_id, use_global_device_ids)
        return xlac._xla_all_gather(x, dim % x.dim(), self.tp, self.groups, False, 1, True)


def build_graph_module(spec, tp: int, max_len: int, dtype: torch.dtype, capture: bool = False,
                       module_cls=None, sliding_cache: str = "linear", slots: int = 1,
                       quantize: str | None = None) -> nn.Module:
    """The traced module of harness/port/graphs.py with XLA collectives, in eval mode without grads: a
    parity build (captures) or, as the Neuron backend builds it, a perf build returning only the
    last real row's logits; with `slots` > 1 a batched build taking seq_ids (a batched perf build
    returns each row's last real row, as the Neuron backend's does)."""
    module_cls = module_cls or traced_class(spec, batched=slots > 1)  # the 12B's decoder or the family's
    linears = (RankLinears if quantize is None else QuantizedLinears)(XlaCollectives(tp))
    module = module_cls(spec, tp, max_len, dtype, linears, with_captures=capture,
                        last_row_only=not capture, sliding_cache=sliding_cache, slots=slots)
    module.eval()
    module.requires_grad_(False)
    return module


@contextlib.contextmanager
def bound(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Temporarily make `tensors` the module's parameters and buffers (by dotted name)."""
    saved = []
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        table = sub._parameters if leaf in sub._parameters else sub._buffers
        if leaf not in table:
            raise GraphBuildError(f"the graph module has no parameter or buffer {name!r}")
        saved.append((table, leaf, table[leaf]))
        table[leaf] = tensor
    try:
        yield
    finally:
        for table, leaf, old in reversed(saved):
            table[leaf] = old


def rank_step(module: nn.Module, tensors: dict[str, torch.Tensor], kv_names: list[str], *inputs):
    """One rank's graph on `tensors` and the graph inputs: (outputs, new state). State is what
    forward reassigned (NxD's rule); a KV buffer updated in place, or left alone, is not state."""
    with bound(module, tensors):
        out = module(*inputs)
        current = {name: module.get_buffer(name) for name in kv_names}
    new_state = {name: t for name, t in current.items() if t is not tensors[name]}
    return (list(out) if isinstance(out, (tuple, list)) else [out]), new_state


@dataclass
class LoweredGraph:
    """One rank's graph as torch-xla lowered it: HLO text (aliases in its header, as a tracer that
    hands state to a compiler declares them), and what each entry parameter and output is."""
    tag: str
    length: int
    rank: int
    hlo: str
    params: list[tuple[str, str]]  # per entry parameter, in order: (role, name); role is input,
    # weight, constant (model-code buffers), state (KV cache) or scalar (a literal torch-xla lifted)
    outputs: list[str]  # names of the result elements: logits, captures, then state
    host_transfers: int = 0  # device->host transfers or executions while tracing (a host round trip)
    extra: dict = field(default_factory=dict)


def _with_aliases(hlo: str, aliases: dict[int, int]) -> str:
    """Write input_output_alias={ {out}: (param, {}, may-alias), ... } into the module header."""
    if not aliases:
        return hlo
    first, _, rest = hlo.partition("\n")
    entries = ", ".join(f"{{{o}}}: ({p}, {{}}, may-alias)" for o, p in sorted(aliases.items()))
    name, comma, tail = first.partition(", ")
    return f"{name}, input_output_alias={{ {entries} }}{comma}{tail}\n{rest}"


def _transfers(metrics) -> int:
    data = metrics.metric_data("TransferFromDeviceTime")
    executed = metrics.counter_value("ExecuteReplicated") or 0
    return (data[0] if data else 0) + executed


def lower_graph(module: nn.Module, tensors: dict[str, torch.Tensor], roles: dict[str, str], tag: str,
                length: int, rank: int = 0, device=None, batch: int = 1) -> LoweredGraph:
    """Trace one rank's graph on an XLA device (no execution) and return its HLO and signature.

    `tensors` are the rank's weights, constants and KV state, `roles` their role; `batch` the rows
    of a batched build's graph (TracedBatchDecoder; its batch bucket). `device`: the CPU lane's by
    default; on an inf2 host the Neuron XLA device (what torch-neuronx traces on)."""
    import torch_xla
    import torch_xla.debug.metrics as metrics

    device = xla_runtime().device if device is None else device
    xlac = torch_xla._XLAC
    kv_names = [n for n, r in roles.items() if r == "state"]
    local = {n: t.to(device) for n, t in tensors.items()}
    last_row = getattr(module, "last_row_only", False) and not is_verify_tag(tag)
    if isinstance(module, TracedBatchDecoder):  # seq_ids: the KV slot of each row
        examples = batch_example_inputs(length, input_width(module.spec), module.dtype, batch, last_row=last_row)
        input_names = ("inputs_embeds", "positions", "seq_ids", "last_index")
    else:
        examples = example_inputs(length, input_width(module.spec), module.dtype, last_row=last_row)
        input_names = ("inputs_embeds", "positions", "last_index")
    inputs = [t.to(device) for t in examples]
    named = {**{n: (roles[n], t) for n, t in local.items()},
             **{n: ("input", t) for n, t in zip(input_names, inputs)}}
    # each tensor's device buffer, taken before tracing (tensor ids change under in-place ops)
    handles = xlac._get_tensors_handle([t for _, t in named.values()])
    by_handle = {h: (role, n) for h, (n, (role, _)) in zip(handles, named.items())}
    metrics.clear_all()
    xlac._set_all_reduce_token(str(device), None)  # collectives of an earlier trace must not chain in
    outputs, new_state = rank_step(module, local, kv_names, *inputs)
    host_transfers = _transfers(metrics)
    state_out = [n for n in kv_names if n in new_state]
    results = outputs + [new_state[n] for n in state_out]
    _, data = xlac._get_tensors_xla_device_data_node(results)  # in entry-parameter order
    params = [by_handle.get(h, ("scalar", f"literal{k}")) for k, h in enumerate(xlac._get_tensors_handle(data))]
    aliases = {len(outputs) + j: params.index(("state", n)) for j, n in enumerate(state_out)
               if ("state", n) in params}
    hlo = _with_aliases(xlac._get_xla_tensors_hlo(results), aliases)
    xlac._set_all_reduce_token(str(device), None)  # nothing of this trace is ever executed
    names = ["logits"] + list(getattr(module, "capture_names", []) or [])[:len(outputs) - 1]
    names += [f"output{k}" for k in range(len(names), len(outputs))]
    return LoweredGraph(tag, length, rank, hlo, params=params, outputs=names + state_out,
                        host_transfers=host_transfers)


def graph_tensors(module: nn.Module, state: dict[str, torch.Tensor] | None = None):
    """(tensors, roles) of a graph module: its weights as they are (or `state`, a rank's weights),
    its constant buffers and zeroed KV state."""
    kv = kv_buffer_names(module)
    constants = constant_buffers(module)
    weights = state if state is not None else {n: t.detach() for n, t in module.state_dict().items()}
    tensors = {**weights, **constants, **{n: torch.zeros_like(module.get_buffer(n)) for n in kv}}
    roles = {**{n: "weight" for n in weights}, **{n: "constant" for n in constants}, **{n: "state" for n in kv}}
    return tensors, roles


# ==== the backend ==================================================================================

class XlaBackend:
    """Runs the port's device graphs through torch-xla on CPU at tensor parallel degree `tp` (same
    interface as CpuBackend and NeuronBackend, harness.backends.Backend): one prefill graph per
    bucket and the decode graph, a parity build (captures as extra outputs) when `capture=True`."""

    name = "xla"

    OPTIONS: dict = {}  # no backend options
    reads_cache, host_ranks, serves_batch = True, False, True
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
