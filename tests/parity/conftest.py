"""Parity-suite fixtures: one port run per (seed, backend), shared by the layered tests."""

from __future__ import annotations

import pytest
import torch

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
