"""Parity-suite fixtures: one port run per (seed, backend), shared by the layered tests."""

from __future__ import annotations

import pytest
import torch

# The device build of the neuron parametrisation (tests/unit/test_inf2_budget.py plans it): port_check's
# parity build (every tiny seed has the same graphs: one compile).
DEVICE_BUILDS = [{"model": "tiny", "buckets": [16, 64, 256], "kv_len": 256, "batch": 1, "capture": True}]
BACKENDS = ["cpu", pytest.param("xla", marks=pytest.mark.xla), pytest.param("neuron", marks=pytest.mark.neuron)]


@pytest.fixture(scope="session", params=BACKENDS)
def backend_name(request):
    return request.param


@pytest.fixture(scope="session")
def port_check(tiny_ckpt, tiny_reference, backend_name):
    """The port (TP=2, bf16) on `backend_name` judged against the tiny model's references."""
    from harness.backends import build_engine
    from harness.parity.check import check_port

    from harness.base.settings import RunSettings

    engine = build_engine(tiny_ckpt, RunSettings(backend=backend_name, buckets=(16, 64, 256), kv_len=256),
                          capture=True)
    return check_port(tiny_ckpt, engine, tiny_reference["float32"], tiny_reference["bfloat16"])
