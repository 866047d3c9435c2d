"""One call of a module lowered by torch-xla on the CPU PJRT device for an HLO bundle
(harness/bundle): the HLO module as text and as a serialized HloModuleProto, every entry parameter's
value in order (the module's weights and buffers, the call's inputs, and the scalars torch-xla lifted
into parameters), and the reference run of that same proto on XLA's CPU backend. With xla_env.py,
xla_lower.py and xla.py the only modules that import torch_xla.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harness.backends.xla_env import xla_runtime

LOWERED_BY = "torch-xla {version} on the CPU PJRT device (gemma-parity's XLA lane path, harness/backends/xla_bundle.py)"


@dataclass
class LoweredCall:
    text: str  # the HLO module text, as torch-xla prints it
    proto: bytes  # the same module as a serialized HloModuleProto (what neuronx-cc reads)
    params: list[tuple[str, torch.Tensor]]  # entry parameters in order: (name, value on the host)
    outputs: list[str]  # names of the root tuple's elements
    expected: list[torch.Tensor]  # the reference run of `proto` on XLA's CPU backend
    lowered_by: str


def lower_call(module: nn.Module, call, inputs: dict[str, torch.Tensor], output_names: list[str],
               tensors: dict[str, torch.Tensor] | None = None) -> LoweredCall:
    """`call(*inputs)` (a bound method of `module`) traced on the XLA device, nothing executed, then the
    lowered module run once on the CPU backend with the parameters' recorded values. `tensors`: the
    module's weights and buffers by name, bound on the device as xla_lower does (a device graph);
    else the module itself is moved to the device."""
    from harness.backends.xla_lower import bound

    rt = xla_runtime()
    xlac, device = rt.torch_xla._XLAC, rt.device
    local = {n: t.to(device) for n, t in (tensors or {}).items()}
    if tensors is None:
        module.to(device)
    try:
        args = {n: t.to(device) for n, t in inputs.items()}
        named = ({f"w.{n}": t for n, t in local.items()} if tensors is not None else
                 {**{f"w.{n}": t for n, t in module.named_parameters()},
                  **{f"b.{n}": t for n, t in module.named_buffers()}})
        named.update(args)
        handles = dict(zip(xlac._get_tensors_handle(list(named.values())), named))
        xlac._set_all_reduce_token(str(device), None)  # an earlier trace's collectives must not chain in
        with torch.no_grad(), bound(module, local):
            out = call(*args.values())
        results = [t for t in out]
        if len(results) != len(output_names):
            raise ValueError(f"the call returned {len(results)} outputs for {len(output_names)} names")
        text = xlac._get_xla_tensors_hlo(results)
        proto = xlac._get_xla_tensors_hlo_proto(results)
        _, data = xlac._get_tensors_xla_device_data_node(results)  # in entry-parameter order
        names = [handles.get(h, f"literal{k}") for k, h in enumerate(xlac._get_tensors_handle(data))]
        params = [(n, t.cpu()) for n, t in zip(names, data)]
    finally:
        if tensors is None:
            module.to("cpu")
    expected = run_proto(proto, [t for _, t in params])
    return LoweredCall(text, proto, params, list(output_names), expected=expected,
                       lowered_by=LOWERED_BY.format(version=rt.torch_xla.__version__))


def run_proto(proto: bytes, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """The serialized module compiled and run on XLA's CPU backend (torch-xla's own client)."""
    import torch_xla.core.xla_builder as xb

    rt = xla_runtime()
    computation = xb.computation_from_module_proto("bundle", proto)
    out = rt.torch_xla._XLAC._xla_user_computation("xla::bundle", [v.to(rt.device) for v in values], computation)
    return [t.cpu() for t in out]
