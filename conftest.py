"""Shared fixtures, the hypothesis profiles, and the Neuron skip/fail logic (no test bodies here)."""

from __future__ import annotations

import functools
import glob
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TINY_SEEDS = (0, 1)
NEURON_CORES_PER_WORKER = 2  # the port runs at TP=2

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Tiny models on a shared 2-core machine: intra-op threads of several workers fight for the
    # cores and make each op 10-20x slower; one thread per worker is the fast setting.
    torch.set_num_threads(1)


def _neuron_cores() -> int:
    try:
        from harness.backends.neuron import neuron_core_count
    except ImportError:
        return 2 * len(glob.glob("/dev/neuron[0-9]*"))
    return neuron_core_count()


def xla_available() -> bool:
    """torch-xla importable next to the torch it is built for (2.9): the XLA lane's environment."""
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None and torch.__version__.startswith("2.9.")


def _selects_neuron(config) -> bool:
    expr = config.getoption("-m") or ""
    return "neuron" in expr and "not neuron" not in expr


def pytest_collection_modifyitems(config, items):
    from tests.smoke import mark_smoke

    mark_smoke(items)  # before -m selects: the PR lane's list lives in tests/smoke.py
    if _selects_neuron(config):
        if _neuron_cores() == 0:
            raise pytest.UsageError(
                "pytest -m neuron selects device tests but this machine has no NeuronCore "
                "(no /dev/neuron* devices). Run it on an inf2 instance with the Neuron SDK installed; "
                "on CPU run plain `pytest`."
            )
        from harness.backends.neuron import assign_visible_cores

        # Each pytest-xdist worker gets its own NeuronCores (TP=2 needs two), before any runtime
        # starts in this process: two workers sharing a core fail to load their models.
        assign_visible_cores(cores_per_worker=NEURON_CORES_PER_WORKER)
        return
    skip = pytest.mark.skip(reason="needs a NeuronCore and the Neuron SDK: run `pytest -m neuron` on inf2")
    skip_xla = pytest.mark.skip(reason="needs torch 2.9 + torch-xla 2.9: run the XLA lane, bash .ci/xla-lane")
    has_xla = xla_available()
    for item in items:
        if item.get_closest_marker("neuron") is not None:  # the marker, not any node named "neuron"
            item.add_marker(skip)
        elif item.get_closest_marker("xla") is not None and not has_xla:
            item.add_marker(skip_xla)


@pytest.fixture(scope="session", params=[pytest.param(seed, id=f"seed{seed}", marks=() if seed == TINY_SEEDS[0]
                                                      else pytest.mark.slow) for seed in TINY_SEEDS])
def tiny_dir(request):
    """The tiny 12B-shaped checkpoint directory, one per seed (built once, cached on disk). The
    default lane runs the first seed; the others (each a whole parity run) are in the slow lane."""
    from harness.inputs.tiny import tiny_checkpoint

    return tiny_checkpoint(seed=request.param)


@pytest.fixture(scope="session")
def tiny0_dir():
    from harness.inputs.tiny import tiny_checkpoint

    return tiny_checkpoint(seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_dir):
    from harness.inputs.checkpoint import Checkpoint

    return Checkpoint.open(tiny_dir)


@pytest.fixture(scope="session")
def tiny0_ckpt(tiny0_dir):
    from harness.inputs.checkpoint import Checkpoint

    return Checkpoint.open(tiny0_dir)


@pytest.fixture(scope="session")
def default_prompts():
    from harness.inputs.prompts import load_prompts

    return load_prompts()


@functools.lru_cache(maxsize=None)
def _reference(seed: int, prompts: tuple[tuple[int, ...], ...]):
    from harness.inputs.tiny import tiny_checkpoint
    from harness.reference.run import run_reference

    return run_reference(tiny_checkpoint(seed=seed), [list(p) for p in prompts], new_tokens=8)


@pytest.fixture(scope="session")
def tiny_reference(tiny_dir, default_prompts):
    """fp32 and bf16 reference results for the default prompts (8 new tokens), per seed."""
    seed = int(tiny_dir.name.rsplit("seed", 1)[1])
    return _reference(seed, tuple(map(tuple, default_prompts)))


@pytest.fixture(scope="session")
def tiny0_reference(tiny0_dir, default_prompts):
    return _reference(0, tuple(map(tuple, default_prompts)))


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def inexact_scale_ckpt(tmp_path_factory):
    """The tiny config (the fault catalog's hidden-72 variant) at a hidden size whose sqrt is not a bf16 number, built once in tmp."""
    from harness.inputs.checkpoint import Checkpoint
    from tests.faults.catalog import inexact_scale_checkpoint

    return Checkpoint.open(inexact_scale_checkpoint(tmp_path_factory.mktemp("inexact-scale")))


@pytest.fixture(scope="session")
def inexact_scale_reference(inexact_scale_ckpt, default_prompts):
    """fp32 and bf16 references of the variant for the default prompts (8 new tokens)."""
    from harness.inputs.prompts import DEFAULT_NEW_TOKENS
    from harness.reference.run import run_reference

    return run_reference(inexact_scale_ckpt.path, default_prompts, new_tokens=DEFAULT_NEW_TOKENS)


@pytest.fixture(scope="session")
def long_dir(tmp_path_factory):
    """The tiny config at a window of 8 (tests/faults/catalog.py, LONG): prompts of 2-4 windows."""
    import json

    from harness.inputs.tiny import TINY_CONFIG, build_tiny_checkpoint
    from tests.faults.catalog import LONG_WINDOW

    out = tmp_path_factory.mktemp("long-context")
    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"]["sliding_window"] = LONG_WINDOW
    path = out / "window8.json"
    path.write_text(json.dumps(config))
    return build_tiny_checkpoint(out / "checkpoint", seed=0, config_path=path)


@pytest.fixture(scope="session")
def long_ckpt(long_dir):
    from harness.inputs.checkpoint import Checkpoint

    return Checkpoint.open(long_dir)


@pytest.fixture(scope="session")
def long_prompts():
    from harness.inputs.prompts import load_prompts
    from tests.faults.catalog import LONG_PROMPTS

    return load_prompts(LONG_PROMPTS)


@pytest.fixture(scope="session")
def long_reference(long_dir, long_prompts):
    """fp32 and bf16 references of the long prompts (8 new tokens, decode past the window)."""
    from harness.reference.run import run_reference
    from tests.faults.catalog import LONG_NEW_TOKENS

    return run_reference(long_dir, long_prompts, new_tokens=LONG_NEW_TOKENS)
