"""Every device build planned, paid for and enforced (issue 46), through the NxD contract double:
the double loads a build the way the runtime does (a core's 16 GiB: weights in the dtype they load,
states, each graph's I/O and binary, the runtime's reserve) and counts every compile against a job's
budget; the harness's gate (backends/neuron_gate.py) fits and counts each build before tracing by
the plan's own fit (port/core_fit.py), so what the plan prints is what loads."""

from __future__ import annotations

import pytest
import torch

from harness.backends import neuron_env
from harness.base.errors import ShardingError
from harness.base.settings import RunSettings
from tests.nxd_double import installed


@pytest.fixture
def nxd(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "neuron-cache"))
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setattr(neuron_env, "neuron_core_count", lambda: 16)
    from harness.backends.neuron_gate import LEDGER

    LEDGER.state(None, "")
    with installed(monkeypatch):
        import libneuronxla

        libneuronxla.COMPILED.clear()
        yield libneuronxla.COMPILED
    LEDGER.state(None, "")


def small(**kw) -> RunSettings:
    return RunSettings(backend="neuron", tp=2, buckets=(16,), kv_len=32, **kw)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_plans_fit_is_what_loads_and_a_core_too_small_fails_the_load(nxd, tiny0_ckpt, monkeypatch, quantize):
    """The plan's per-core weights (int8 codes and scales under --quantize), KV and graph count are
    the loaded build's exactly, its graphs' I/O within 10%; a core one byte short of the load fails
    it as the runtime would (out of device memory), naming the parts."""
    from harness.backends import build_engine
    from harness.backends.neuron import NeuronBuildError
    from harness.port.core_fit import GRAPH_OVERHEAD_BYTES, core_bytes

    settings = small(quantize=quantize)
    loaded = build_engine(tiny0_ckpt, settings).backend.nxd_model.device_memory
    plan = core_bytes(tiny0_ckpt.spec, 2, "bfloat16", 32, buckets=(16,), perf=True, quantize=quantize)
    assert (plan["weights"], plan["kv_cache"], plan["graphs"]) == (loaded["weights"], loaded["states"], loaded["graphs"])
    io = plan["graph_bytes"] - plan["graphs"] * GRAPH_OVERHEAD_BYTES
    assert abs(io - loaded["io"]) <= 0.1 * loaded["io"], (io, loaded["io"])
    monkeypatch.setenv("NXD_DOUBLE_CORE_BYTES", str(loaded["total"] - 1))
    with pytest.raises(NeuronBuildError, match="out of device memory"):
        build_engine(tiny0_ckpt, settings)  # the cache hit: nothing compiles, the load fails


def test_int8_weights_are_what_the_plan_fits_on_a_core(tiny0_ckpt):
    """Default-lane sibling of the load test: the plan's int8 weights per core are the rank state
    dicts' bytes as the port loads them (codes, scales, and the unquantized rest)."""
    from harness.port.core_fit import core_bytes
    from harness.port.sharding import rank_state_dicts

    for quantize in (None, "int8"):
        ranks = rank_state_dicts(tiny0_ckpt, 2, torch.bfloat16, **({"quantize": quantize} if quantize else {}))
        loaded = max(sum(t.numel() * t.element_size() for t in r.values()) for r in ranks)
        assert core_bytes(tiny0_ckpt.spec, 2, quantize=quantize)["weights"] == loaded, quantize


def test_every_cold_build_is_counted_against_the_runs_stated_budget(nxd, tiny0_ckpt, monkeypatch):
    """The run states its plan's graphs: a cold build within them compiles, one past them is refused
    before tracing (nothing compiled), a cached build costs nothing; the double fails the compile
    past a job's budget as a timed-out job would."""
    from harness.backends import build_engine
    from harness.backends.neuron_gate import LEDGER

    from harness.plan.compile_budget import graphs_by_stage

    graphs = graphs_by_stage("bench", (16,), 32)["perf build"]  # the plan of one perf build
    LEDGER.state(graphs, "a test's plan")
    assert len(build_engine(tiny0_ckpt, small()).backend.kv_graphs) == graphs == LEDGER.compiled
    assert len([c for c in nxd if c["kind"] == "graph"]) == graphs  # what the double compiled
    build_engine(tiny0_ckpt, small())  # cached: no cold graph
    assert LEDGER.compiled == graphs and not LEDGER.builds[-1].cold
    compiled = len(nxd)
    with pytest.raises(ShardingError, match="outside the run's plan"):
        build_engine(tiny0_ckpt, small(), capture=True)  # a parity build the plan did not count
    assert len(nxd) == compiled  # refused before any trace or compile
    LEDGER.state(None, "")
    monkeypatch.setenv("NXD_DOUBLE_COMPILE_BUDGET", str(compiled + 1))
    with pytest.raises(Exception, match="compile budget of"):
        build_engine(tiny0_ckpt, small(), capture=True)


def test_a_build_over_a_core_is_refused_before_tracing(nxd, tiny0_ckpt, monkeypatch):
    """The gate's fit is the plan's: a build the plan says is over a core never traces."""
    from harness.backends import build_engine
    from harness.backends import neuron_gate

    monkeypatch.setattr(neuron_gate, "CORE_HBM", 1 << 20)
    with pytest.raises(ShardingError, match="refused before tracing"):
        build_engine(tiny0_ckpt, small())
    assert nxd == []


def test_the_speculative_stage_builds_fp32_on_the_host():
    """check --backend neuron --assistant A --speculate K: the stage's fp32 run goes to the host, as
    the fp32 stage's does (its device build would be one no plan counts: the 12B's fp32 parity build
    is over a NeuronCore); its run in the run's dtype is the parity build the plan counts (the same
    settings: the same cache entry)."""
    from harness.parity.speculative import speculative_settings
    from harness.port.core_fit import CORE_HBM, core_bytes
    from harness.inputs.spec import load_spec
    from harness import FIXTURES_DIR

    settings = RunSettings(backend="neuron", tp=2, speculate=3, assistant="A", backend_options={"cache_dir": "x"})
    runs = speculative_settings(settings, 3, "A")
    assert [(s.backend, s.dtype) for s in runs] == [("neuron", settings.dtype), ("cpu", "float32")]
    assert runs[0] == settings and runs[1].backend_options == {}
    spec = load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")
    assert core_bytes(spec, 2, "float32", speculate=3)["total"] > CORE_HBM  # what the device build would have needed


@pytest.mark.slow  # a batch-8 build through the double (24 graphs traced and compiled)
@pytest.mark.parametrize("declared", [0, 1])
def test_the_device_jobs_planned_builds_are_what_the_double_compiles(nxd, tiny0_ckpt, declared):
    """The builds tests/perf/test_device_budgets.py declares (what the device job's budget counts),
    made at their shapes on the tiny model: the double compiles exactly the graphs the budget test
    counts for them (tests/unit/test_inf2_budget.py build_graphs)."""
    from harness.backends import build_engine
    from tests.perf.test_device_budgets import DEVICE_BUILDS
    from tests.unit.test_inf2_budget import build_graphs

    b = DEVICE_BUILDS[declared]
    settings = RunSettings(backend="neuron", tp=2, buckets=tuple(b["buckets"]), kv_len=b["kv_len"], batch=b["batch"])
    build_engine(tiny0_ckpt, settings, capture=b["capture"])
    assert len([c for c in nxd if c["kind"] == "graph"]) == build_graphs(b)
