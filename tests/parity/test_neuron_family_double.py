"""The Gemma-4 family on the Neuron backend, through the NxD contract double (tests/nxd_double).

Each variant's tiny transformers-built checkpoint (tests/family/shared.py) is traced, compiled and
run at TP 2 exactly as NeuronBackend builds it on inf2: `graphs.traced_class(spec)` with NxD's
parallel layers, the per-layer rows appended to the graphs' one input (E2B/E4B), no KV state for
KV-shared layers, the MoE experts' per-rank slices reduced by NxD's own all-reduce. `check` passes
both stages on every variant (the MoE's bf16 stage with its routing teacher-forced, harness/judge/routing.py),
and the MoE variant's bf16 run is the CPU backend's bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.backends import build_engine, neuron, neuron_env
from harness.base.settings import RunSettings
from harness.parity.check import check_port
from harness.port.blocks import SharedKVAttention
from harness.port.graphs import input_width
from harness.port.sharding import rank_state_dicts
from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_KV_LEN, FAMILY_PROMPTS
from tests.family.shared import family_checkpoint, family_reference
from tests.nxd_double import installed
from harness.port.decode import generate

TP = 2
MOE = "26b-a4b"
# The default lane runs `check` on E2B (per-layer inputs, KV sharing, double-wide MLP) and the MoE
# variant's bf16 run against the CPU backend's; `check` on the 31B-shaped and E4B-shaped ones (the
# same blocks: k_eq_v and replicated KV heads, KV sharing without the wide MLP) and on the MoE one
# (whose routing policy re-runs the references) are in the slow lane: each computes its variant's
# transformers references (up to ~10 s on an idle 2-core machine, several times that under load).
VARIANTS = (pytest.param("31b", marks=pytest.mark.slow), "e2b", pytest.param("e4b", marks=pytest.mark.slow), MOE)
# Each variant's whole check through the double is in the slow lane (about 13 CPU-seconds each); the
# default lane keeps the variants' builds, graphs and bit-for-bit runs above and below.
CHECKED = tuple(pytest.param(v, marks=pytest.mark.slow) for v in ("31b", "e2b", "e4b", MOE))


@pytest.fixture(scope="module")
def nxd(tmp_path_factory):
    """The double on sys.path, a fresh artifact cache, and NeuronCores the core assignment can use
    (as tests/parity/test_neuron_double.py sets them up)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path_factory.mktemp("neuron-cache")))
        mp.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
        mp.setattr(neuron_env, "neuron_core_count", lambda: 16)
        with installed(mp):
            yield


def _settings(backend: str, dtype: str = "bfloat16") -> RunSettings:
    return RunSettings(backend=backend, tp=TP, dtype=dtype, buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN)


@pytest.fixture(scope="module")
def parity_builds(nxd):
    """variant -> the neuron parity build's engine, built once per module."""
    built: dict = {}

    def get(variant: str):
        if variant not in built:
            built[variant] = build_engine(family_checkpoint(variant), _settings("neuron"), capture=True)
        return built[variant]

    return get


@pytest.mark.parametrize("variant", CHECKED)
def test_check_passes_both_stages_through_the_double(parity_builds, variant):
    ckpt, refs = family_checkpoint(variant), family_reference(variant)
    engine = parity_builds(variant)
    result = check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=False)
    assert result.fp32.passed and result.passed, result.failures() + result.fp32.failures()


@pytest.fixture(scope="module")
def moe_cpu16():
    return build_engine(family_checkpoint(MOE), _settings("cpu"), capture=True)


def test_moe_bf16_run_is_the_cpu_ports_bit_for_bit(parity_builds, moe_cpu16):
    """26B-A4B in bf16: the double's run (NxD's layers, the experts' NxD all-reduce) is the CPU
    backend's bit for bit: greedy tokens, logits, every capture (router logits and the chosen
    experts' weights included) and the decode steps' logits and captures."""
    dev = parity_builds(MOE)
    ids = FAMILY_PROMPTS[0]
    got, want = (generate(e, [ids], 4, capture=True)[0] for e in (dev, moe_cpu16))
    assert got.tokens == want.tokens
    assert torch.equal(got.prefill.logits, want.prefill.logits)
    assert torch.equal(got.step_logits, want.step_logits)
    for got_caps, want_caps in ((got.prefill.captures, want.prefill.captures), (got.step_captures, want.step_captures)):
        assert list(got_caps) == list(want_caps)
        assert any(name.endswith("expert_weights") for name in got_caps)
        for name, tensor in got_caps.items():
            assert torch.equal(tensor, want_caps[name]), name


# the MoE's instance TP in the default lane, the 31B's at TP 8 in the slow lane
@pytest.mark.parametrize("variant, tp", [pytest.param("31b", 8, marks=pytest.mark.slow), (MOE, 4)])
def test_the_instances_tp_runs_as_the_cpu_port(nxd, monkeypatch, variant, tp):
    """Past one chip's TP 2, as the 31B (TP 8: its global layers' few KV heads replicated whole, each
    rank holding its query group's head, so ranks hold different ones) and the 26B-A4B (TP 4: each
    rank 1/4 of every expert) run on their instances: the double's bf16 run is the CPU backend's
    bit for bit."""
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", f"0-{tp - 1}")
    ckpt = family_checkpoint(variant)
    settings = replace(_settings("neuron"), tp=tp)
    dev, cpu = build_engine(ckpt, settings, capture=True), build_engine(ckpt, replace(settings, backend="cpu"), capture=True)
    assert dev.backend.tp == tp and len(dev.backend.nxd_model.weights) == tp
    got, want = (generate(e, [FAMILY_PROMPTS[1]], 3, capture=True)[0] for e in (dev, cpu))
    assert got.tokens == want.tokens and torch.equal(got.prefill.logits, want.prefill.logits)
    for name, tensor in got.prefill.captures.items():
        assert torch.equal(tensor, want.prefill.captures[name]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_graphs_are_the_family_module(parity_builds, variant):
    """What the compiled graphs are made of: the family's traced class, an input of the hidden size
    plus each layer's per-layer row, no KV state for a KV-shared layer, and exactly the weights
    harness.port.sharding gives each rank (router, experts, per-layer projections and gates, extra norms,
    k_eq_v layers without v_proj), each rank its own slice."""
    be = parity_builds(variant).backend
    spec = be.spec
    decode = min((kv, tag) for tag, (n, kv) in be.kv_graphs.items() if n == 1)[1]  # decode at the smallest KV bucket
    traced = be.nxd_model.traced_modules[decode]
    assert type(traced).__name__ == "TracedFamilyDecoder"
    art = be.nxd_model.graphs[decode]
    assert art.provided[0][1] == (1, 1, input_width(spec))
    shared = set(spec.shared_layers)
    assert {int(name.split(".")[1]) for name in be.state_specs} == set(range(spec.num_layers)) - shared
    parity_builds(variant).prefill(FAMILY_PROMPTS[0][:12])
    for i in shared:  # a shared layer's cache, read back, is its source's (as on the CPU backend)
        assert isinstance(traced.layers[i].self_attn, SharedKVAttention)
        source = be.kv_cache(spec.layers[i].kv_source, 1)
        assert source[0][0, :, :12].abs().sum() > 0
        assert all(torch.equal(a, b) for a, b in zip(be.kv_cache(i, 1), source, strict=True))
    states = rank_state_dicts(family_checkpoint(variant), TP, torch.bfloat16)
    assert set(be.weight_specs) == set(states[0])
    for rank in range(TP):
        for name, tensor in be.nxd_model.weights[rank].items():
            assert torch.equal(tensor, states[rank][name]), (rank, name)
    if spec.moe is not None:
        experts = traced.layers[0].experts
        assert isinstance(experts.collectives, neuron.NxDCollectives)
        assert experts.gate_up_proj.shape[1] == 2 * spec.moe.intermediate_size // TP
        gate_up = [be.nxd_model.weights[r]["layers.0.experts.gate_up_proj"] for r in range(TP)]
        assert not torch.equal(gate_up[0], gate_up[1])  # each rank its own slice of every expert
    if spec.per_layer_input_size:
        assert "per_layer.per_layer_model_projection.weight" in be.weight_specs


def test_moe_experts_without_nxd_reduce_give_partial_sums(nxd, monkeypatch, tmp_path):
    """The double executes each rank on its own slice of the experts: a build whose experts' reduce
    is not NxD's (the base Collectives, a no-op) returns each rank's partial sum, so its outputs
    leave the CPU port's. What the experts' NxD all-reduce is for."""
    from harness.port.model import Collectives

    ckpt = family_checkpoint(MOE)
    real = neuron.NeuronLinears.__init__

    def init(self, tp, dtype, reduce_dtype=torch.float32):
        real(self, tp, dtype, reduce_dtype)
        self.collectives = Collectives()

    monkeypatch.setattr(neuron.NeuronLinears, "__init__", init)
    # its own cache: a test edit the model source hash cannot see
    broken = build_engine(ckpt, replace(_settings("neuron", "float32"), backend_options={"cache_dir": str(tmp_path)}))
    cpu = build_engine(ckpt, _settings("cpu", "float32"))
    ids = FAMILY_PROMPTS[0]
    got, want = broken.prefill(ids).logits, cpu.prefill(ids).logits[-1:]
    assert not torch.allclose(got.float(), want.float(), atol=1e-3)


def test_a_shared_layer_holding_a_cache_of_its_own_fails_the_build(nxd, monkeypatch, tmp_path):
    """A KV-shared layer given a cache of its own, as an unshared layer has, never writes it: NxD
    makes state only of buffers reassigned in forward, so that cache would be a weight of zeros, not
    device state. The build fails with a NeuronBuildError naming the buffers, and nothing reaches the
    artifact cache."""
    from harness.port.kv_cache import KVCache

    real = SharedKVAttention.__init__

    def init(self, spec, layer, plan, linears):
        real(self, spec, layer, plan, linears)
        self.cache = KVCache(plan.kv_heads_per_rank, FAMILY_KV_LEN, layer.head_dim, torch.bfloat16)

    monkeypatch.setattr(SharedKVAttention, "__init__", init)
    ckpt = family_checkpoint("e2b")
    first = ckpt.spec.shared_layers[0]
    with pytest.raises(neuron.NeuronBuildError, match=rf"KV cache buffers \['layers\.{first}\.self_attn\.cache\.k'.*"
                                                      "did not become aliased device state"):
        neuron.NeuronBackend(ckpt, _settings("neuron"), cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if p.name != ".work"] == []
