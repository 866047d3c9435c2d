"""The graph contracts on the module the Neuron backend traces: harness/port/graphs.py's TracedDecoder
with NxD's parallel layers (the backend's NeuronLinears) under NxDParallelState at TP=2, lowered by
torch-xla on the CPU PJRT device (tracing only, nothing compiled or run); the contracts are the CPU
lane's (tests/xla/test_graph_contracts.py).

Checked on CPU first, in the XLA lane, with NxD's layers from the contract double (tests/nxd_double):
what the neuron backend hands ModelBuilder meets every contract before any device is involved. On
an inf2 host (`-m neuron`) the same lowering runs with the real NxD in a child process on the CPU
PJRT device (PJRT_DEVICE=CPU), never on the Neuron XLA device in the process that loads the NxD
models: NxD's ModelBuilder traces with its CPU backend too. The device half is unverified here (no
NeuronCore); the CPU half is this file's xla test."""

from __future__ import annotations

# No device build: the neuron test lowers the graph with the real NxD on the CPU, compiling nothing
# (tests/unit/test_inf2_budget.py requires every `neuron` module to say what it builds).
DEVICE_BUILDS: list = []

import json
import os
import subprocess
import sys

import pytest
import torch

KV_LEN, BUCKET, TP = 64, 16, 2


def nxd_layer_violations(length: int, module_cls=None) -> dict:
    """Build the tiny model's graph module as NeuronBackend builds it (NeuronLinears under
    NxDParallelState), lower it on the CPU PJRT device and check it: {"violations": [...],
    "layers": names of the parallel layer classes it holds}."""
    from harness.backends.neuron import NeuronLinears, import_neuronx_distributed
    from harness.backends.xla_lower import graph_tensors, lower_graph
    from harness.hlo.contracts import GraphSignature, check_graph
    from harness.hlo.expectation import expectation_for
    from harness.inputs.spec import load_spec
    from harness.inputs.tiny import TINY_CONFIG
    from harness.port.graphs import TracedDecoder

    spec, dtype = load_spec(TINY_CONFIG), torch.bfloat16
    with import_neuronx_distributed().NxDParallelState(world_size=TP, tensor_model_parallel_size=TP, lnc_size=1):
        module = (module_cls or TracedDecoder)(spec, TP, KV_LEN, dtype, NeuronLinears(TP, dtype)).eval()
        module.requires_grad_(False)
        tensors, roles = graph_tensors(module)
        graph = lower_graph(module, tensors, roles, f"len{length}", length)  # the CPU lane's device
    sig = GraphSignature(graph.params, graph.outputs, graph.host_transfers)
    violations = check_graph(graph.hlo, sig, expectation_for(spec, TP, KV_LEN, length, dtype))
    layers = sorted({type(m).__name__ for m in module.modules() if type(m).__module__.startswith("neuronx_distributed")})
    return {"violations": [str(v) for v in violations], "layers": layers}


@pytest.mark.xla
@pytest.mark.parametrize("length", [BUCKET, 1], ids=["prefill", "decode"])
def test_contracts_hold_on_the_nxd_layer_graph_lowered_on_cpu(monkeypatch, length):
    """The double's NxD layers (ColumnParallelLinear, RowParallelLinear, ...) in the traced module,
    lowered on CPU: every contract holds; the layers are NxD's, not the port's RankLinears."""
    from tests.nxd_double import installed

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")  # NxD asks the platform; no device here
    with installed(monkeypatch):
        out = nxd_layer_violations(length)
    assert out["violations"] == []
    assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(out["layers"]), out["layers"]


@pytest.mark.xla
def test_the_nxd_layer_check_fails_on_a_softcap_on_device(monkeypatch):
    """The check above can fail: the final softcap put back in the graph is reported on the NxD-layer
    graph as on the port's."""
    from harness.port.engine import softcap
    from harness.port.graphs import TracedDecoder
    from tests.nxd_double import installed

    class Capped(TracedDecoder):
        def forward(self, inputs_embeds, positions, last_index=None):
            return softcap(super().forward(inputs_embeds, positions, last_index), 30.0)

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    with installed(monkeypatch):
        out = nxd_layer_violations(1, module_cls=Capped)
    assert [v.split(":")[0] for v in out["violations"]] == ["softcap_off_device"], out


@pytest.mark.neuron
@pytest.mark.parametrize("length", [BUCKET, 1], ids=["prefill", "decode"])
def test_contracts_hold_on_the_graphs_the_real_nxd_traces(length):
    """On an inf2 host: the real NxD's layers, lowered in a child process on the CPU PJRT device."""
    code = ("import json, sys; from tests.xla.test_graph_contracts_neuron import nxd_layer_violations; "
            f"print(json.dumps(nxd_layer_violations({length})))")
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["violations"] == [] and out["layers"], out
