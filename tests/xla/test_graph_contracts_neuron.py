"""Under `-m neuron` on an inf2 host: the same graph contracts on what torch-neuronx traces. The
graph module is built exactly as NeuronBackend builds it (harness/port/graphs.py's TracedDecoder with
NxD's parallel layers under NxDParallelState at TP=2) and lowered by the Neuron host's torch-xla
on the Neuron XLA device (tracing only, nothing compiled or run); the contracts are the CPU lane's.
Skipped elsewhere (no NeuronCore), like every neuron test."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.neuron
KV_LEN, BUCKET = 64, 16


@pytest.mark.parametrize("length", [BUCKET, 1], ids=["prefill", "decode"])
def test_contracts_hold_on_the_graphs_torch_neuronx_traces(length):
    import torch_neuronx  # noqa: F401  (registers the Neuron PJRT device)
    import torch_xla

    from harness.backends.neuron import NeuronLinears, import_neuronx_distributed
    from harness.backends.xla import graph_tensors, lower_graph
    from harness.hlo.contracts import GraphSignature, check_graph, expectation_for
    from harness.inputs.spec import load_spec
    from harness.inputs.tiny import TINY_CONFIG
    from harness.port.graphs import TracedDecoder

    spec, tp, dtype = load_spec(TINY_CONFIG), 2, torch.bfloat16
    # NxD through the backend's import (it reaches transformers.utils.fx, absent in transformers 5)
    with import_neuronx_distributed().NxDParallelState(world_size=tp, tensor_model_parallel_size=tp):
        module = TracedDecoder(spec, tp, KV_LEN, dtype, NeuronLinears(tp, dtype)).eval()
        module.requires_grad_(False)
        tensors, roles = graph_tensors(module)
        graph = lower_graph(module, tensors, roles, f"len{length}", length, device=torch_xla.device())
    sig = GraphSignature(graph.params, graph.outputs, graph.host_transfers)
    assert check_graph(graph.hlo, sig, expectation_for(spec, tp, KV_LEN, length, dtype)) == []
