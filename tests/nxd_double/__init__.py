"""A contract double of the Neuron SDK surface the neuron backend uses (test-only).

`sdk/` holds top-level packages named `neuronx_distributed`, `torch_neuronx` and `libneuronxla`,
plus `.dist-info` metadata of the pinned Neuron SDK 2.31 versions. They are importable only while
a test puts `sdk/` on sys.path (`installed`); the harness itself never sees them, so on this
machine `gemma-parity check --backend neuron` still refuses with the install instructions.

The double is written from the public source of aws-neuron/neuronx-distributed (Release 2.29,
commit fbac349 on main, the newest published; v2.28.0 is the newest tag, and every signature and
rule modelled here is the same there: the two differ, in these files, only in RowParallelLinear's
sequence-parallel tile_cc path, which the double does not model) and the Neuron compiler's CLI
reference: each class and function cites the upstream file it models. No upstream code is copied.
Not modelled: the torch-xla lane (torch_xla is not installed here; graphs run eagerly), forward
modes other than 'default', sequence parallelism, padding, start_rank/local_ranks_size.
It enforces the rules that break real builds (trace signatures, example-input shapes, aliased
state, per-rank weights, buffer access order, parallel layer shapes, compiler flag values) and
runs the traced graphs eagerly on CPU, one thread per rank with real collectives between them.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

SDK_DIR = Path(__file__).resolve().parent / "sdk"
TOP_LEVEL = ("neuronx_distributed", "torch_neuronx", "libneuronxla")


def _forget_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in TOP_LEVEL:
            del sys.modules[name]


@contextlib.contextmanager
def installed(monkeypatch, host_platform: str | None = None):
    """Make the double importable (and its pinned metadata visible) for the duration of the block.

    `host_platform`: what torch_neuronx reports as this machine's Neuron platform; None models a
    build host with no Neuron device (as this machine is).
    """
    import importlib.util

    import pytest

    if any(importlib.util.find_spec(name) is not None for name in TOP_LEVEL if name not in sys.modules):
        pytest.skip("a real Neuron SDK is installed here: the double would shadow it (run the double on CPU hosts)")
    _forget_modules()
    monkeypatch.syspath_prepend(str(SDK_DIR))
    importlib.invalidate_caches()
    import torch_neuronx.utils

    monkeypatch.setattr(torch_neuronx.utils, "HOST_PLATFORM", host_platform)
    try:
        yield
    finally:
        _forget_modules()
