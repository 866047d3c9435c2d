"""The Neuron host's environment and the compile's inputs, on CPU: the NeuronCore list a run may use
(refused before any build when smaller than TP), the platform named for a build, the compile-time
environment and runtime version in the cache key, flags joined so quoted values survive, the
compile-worker default for large models, and the transformers.utils.fx stand-in's scope."""

from __future__ import annotations

import shlex
import sys
import types

import pytest
import torch

from harness.backends import neuron, neuron_cache, neuron_env, neuron_gate
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.inputs.spec import load_spec
from harness.port.sharding import bytes_per_rank

# ---- NEURON_RT_VISIBLE_CORES --------------------------------------------------------------------------


@pytest.mark.parametrize("value,cores", [("0-1", [0, 1]), ("2", [2]), ("0,1", [0, 1]), ("0-3,6", [0, 1, 2, 3, 6]),
                                         (" 4 - 5".replace(" ", ""), [4, 5])])
def test_visible_core_lists_are_read_as_the_runtime_reads_them(value, cores):
    assert neuron_env.parse_visible_cores(value) == cores


@pytest.mark.parametrize("value", ["a", "1-0", "0-", "0;1", ""])
def test_malformed_core_lists_are_refused_with_an_example(value):
    with pytest.raises(HarnessInputError, match="NEURON_RT_VISIBLE_CORES=0-1"):
        neuron_env.parse_visible_cores(value)


def test_a_user_core_list_smaller_than_tp_is_refused():
    with pytest.raises(HarnessInputError, match=r"names 1 NeuronCore\(s\) but tp=2 needs 2.*NEURON_RT_VISIBLE_CORES=3-4"):
        neuron_env.assign_visible_cores(2, {"NEURON_RT_VISIBLE_CORES": "3"}, total_cores=8)
    assert neuron_env.assign_visible_cores(2, {"NEURON_RT_VISIBLE_CORES": "0,2"}, total_cores=8) == "0,2"
    assert neuron_env.assign_visible_cores(1, {"NEURON_RT_VISIBLE_CORES": "3"}, total_cores=8) == "3"


def test_the_backend_refuses_the_core_list_before_anything_is_built(monkeypatch, tmp_path):
    monkeypatch.setattr(neuron, "check_neuron_packages", lambda: dict(neuron.PINNED_VERSIONS))
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    checkpoint = types.SimpleNamespace(spec=load_spec("fixtures/configs/gemma-4-tiny.json"))
    with pytest.raises(HarnessInputError, match="tp=2 needs 2"):
        neuron.NeuronBackend(checkpoint, RunSettings(backend="neuron", tp=2), cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == [] and "neuronx_distributed" not in sys.modules


# ---- the build's platform -----------------------------------------------------------------------------

def test_the_build_names_the_flags_target_and_restores_the_environment():
    env: dict[str, str] = {}
    with neuron_env.build_platform(["-O1", "--target", "inf2"], env) as target:
        assert target == "inf2" and env == {"NEURON_PLATFORM_TARGET_OVERRIDE": "inf2"}
    assert env == {}
    with pytest.raises(RuntimeError), neuron_env.build_platform(["--target", "inf2"], env):
        raise RuntimeError("compile failed")
    assert env == {}  # restored on failure too
    same = {"NEURON_PLATFORM_TARGET_OVERRIDE": "inf2"}
    with neuron_env.build_platform(["--target", "inf2"], same):
        pass
    assert same == {"NEURON_PLATFORM_TARGET_OVERRIDE": "inf2"}  # the user's value is left alone
    with pytest.raises(HarnessInputError, match="NEURON_PLATFORM_TARGET_OVERRIDE=trn1 contradicts"):
        with neuron_env.build_platform(["--target", "inf2"], {"NEURON_PLATFORM_TARGET_OVERRIDE": "trn1"}):
            pass
    untouched: dict[str, str] = {}
    with neuron_env.build_platform(["-O1"], untouched) as target:
        assert target is None and untouched == {}
    assert neuron_env.target_of(["--target"]) is None


# ---- the compile's inputs in the cache key ------------------------------------------------------------

def test_compile_environment_and_runtime_version_change_the_key():
    base = {"spec_hash": "s", "buckets": (64,), "tp": 2, "compiler_version": "cc", "compiler_args": ["-O1"],
            "model_source_hash": "m", "capture": False}
    env = neuron_cache.compile_environment("2.25.1", {"PATH": "/bin"})
    assert env == {"neuron-runtime": "2.25.1"}  # unrelated variables stay out
    key = neuron.artifact_cache_key(**base, environment=env)
    for name in neuron_cache.COMPILE_ENV_VARS:
        changed = neuron_cache.compile_environment("2.25.1", {name: "--x"})
        assert neuron.artifact_cache_key(**base, environment=changed) != key, name
    assert neuron.artifact_cache_key(**base, environment=neuron_cache.compile_environment("2.26.0", {})) != key
    assert neuron.artifact_cache_key(**base, environment=dict(env)) == key


def test_runtime_version_from_the_package_manager(monkeypatch):
    monkeypatch.setattr(neuron_env.shutil, "which", lambda name: "/usr/bin/" + name if name == "dpkg-query" else None)
    monkeypatch.setattr(neuron_env.subprocess, "run", lambda cmd, **k: types.SimpleNamespace(stdout="2.25.145.0\n"))
    assert neuron_env.neuron_runtime_version() == "2.25.145.0"
    monkeypatch.setattr(neuron_env.shutil, "which", lambda name: None)
    assert neuron_env.neuron_runtime_version() == "unknown"


# ---- flags --------------------------------------------------------------------------------------------

def test_quoted_flag_values_survive_the_join():
    flags = "-O1 --tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2' --target inf2"
    words = neuron.normalize_compiler_args(flags)
    assert words == ["-O1", "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2",
                     "--target", "inf2"]
    joined = neuron.compiler_flag_string(words)
    assert shlex.split(joined) == words and " --target inf2" in joined  # torch-neuronx still sees the target
    assert neuron.compiler_flag_string(list(neuron.DEFAULT_COMPILER_ARGS)) == " ".join(neuron.DEFAULT_COMPILER_ARGS)
    with pytest.raises(HarnessInputError, match="close the quote"):
        neuron.normalize_compiler_args("--tensorizer-options='--a")


# ---- compile workers ------------------------------------------------------------------------------------

def test_compile_workers_come_from_the_hosts_memory_and_vcpus(monkeypatch):
    """ModelBuilder compiles graphs on a pool: as many at once as the host's memory beside the traced
    rank's weights and its vCPUs allow (the reason says which bound), never fewer than one; this
    host's default reads its own memory and vCPUs (it was 1 for any model over 1 GiB per rank)."""
    big = bytes_per_rank(load_spec("fixtures/configs/gemma-4-12b-it.json"), 2, "bfloat16", 256)["weights"]
    gib = 2**30
    workers, why = neuron_gate.compile_workers(128 * gib, 32, big)  # an inf2.8xlarge
    assert workers == (128 * gib - big) // neuron_gate.COMPILE_PEAK_HOST_BYTES > 1 and "vCPUs" in why
    assert neuron_gate.compile_workers(128 * gib, 4, big)[0] == 2  # the vCPUs bound it
    assert neuron_gate.compile_workers(16 * gib, 32, big)[0] == 1  # memory for none beside the weights: one
    monkeypatch.setattr(neuron_gate.os, "cpu_count", lambda: 6)
    assert neuron_gate.default_compile_workers(0)[0] <= 3


# ---- the transformers.utils.fx stand-in ---------------------------------------------------------------------

def test_the_stand_in_is_removed_even_when_the_nxd_import_fails(monkeypatch):
    stand_in = types.ModuleType(neuron_env.FX_MODULE)
    monkeypatch.setattr(neuron_env, "_fx_stand_in", lambda: stand_in)
    monkeypatch.delitem(sys.modules, neuron_env.FX_MODULE, raising=False)
    monkeypatch.setitem(sys.modules, "neuronx_distributed", None)  # `import` raises ImportError
    with pytest.raises(ImportError):
        neuron_env.import_neuronx_distributed()
    assert neuron_env.FX_MODULE not in sys.modules


def test_no_stand_in_without_transformers_or_with_its_fx(monkeypatch):
    monkeypatch.setattr(neuron_env.importlib.util, "find_spec", lambda name: None)
    assert neuron_env._fx_stand_in() is None
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, neuron_env.FX_MODULE, types.ModuleType(neuron_env.FX_MODULE))
    assert neuron_env._fx_stand_in() is None
    monkeypatch.undo()
    import importlib.util

    if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec(neuron_env.FX_MODULE) is None:
        made = neuron_env._fx_stand_in()
        with pytest.raises(NotImplementedError):
            made.HFTracer()


def test_parity_reduce_dtype_default_is_fp32():
    import inspect

    assert inspect.signature(neuron.NeuronBackend).parameters["reduce_dtype"].default == torch.float32
    # the layout transform off until a device run measures its peak (issue 36)
    assert inspect.signature(neuron.NeuronBackend).parameters["layout_priority"].default is None
