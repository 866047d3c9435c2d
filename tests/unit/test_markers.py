"""`pytest -m neuron` on a machine without a NeuronCore is an error, not a green run of nothing;
plain `pytest` skips the device tests with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(bool(list(Path("/dev").glob("neuron[0-9]*"))), reason="this host has NeuronCores")
def test_neuron_marker_without_device_is_an_error():
    run = _pytest("-m", "neuron", "-q", "tests/perf/test_device_budgets.py")
    assert run.returncode not in (0, 5), run.stdout + run.stderr
    assert "no NeuronCore" in run.stdout + run.stderr


def test_plain_run_skips_device_tests_with_reason():
    run = _pytest("-q", "-rs", "tests/perf/test_device_budgets.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped" in run.stdout and "pytest -m neuron" in run.stdout
