"""One rank's device graph lowered by torch-xla (tracing only, nothing executed): the traced module of
harness/port/graphs.py with XLA collectives (`build_graph_module`), its weights, constants and KV
state bound by name (`bound`, `rank_step`: state is what forward reassigned, NxD's rule), and the
HLO text with its entry parameters' roles and the state aliases (`lower_graph` -> `LoweredGraph`),
what harness/hlo checks and measures.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from harness.backends.xla_env import XlaCollectives, xla_runtime
from harness.port.graphs import (GraphBuildError, TracedBatchDecoder, batch_example_inputs, constant_buffers,
                                 example_inputs, input_width, is_verify_tag, kv_buffer_names, traced_class)
from harness.port.model import RankLinears
from harness.port.quantized import QuantizedLinears


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
