"""`pytest -m neuron` on a machine without a NeuronCore is an error, not a green run of nothing;
plain `pytest` skips the device tests with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)  # a hang guard, not a speed limit


@pytest.mark.skipif(bool(list(Path("/dev").glob("neuron[0-9]*"))), reason="this host has NeuronCores")
def test_neuron_marker_without_device_is_an_error():
    run = _pytest("-m", "neuron", "-q", "tests/perf/test_device_budgets.py")
    assert run.returncode not in (0, 5), run.stdout + run.stderr
    assert "no NeuronCore" in run.stdout + run.stderr


def test_plain_run_skips_device_tests_with_reason():
    run = _pytest("-q", "-rs", "tests/perf/test_device_budgets.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped" in run.stdout and "pytest -m neuron" in run.stdout


def test_default_lane_leaves_out_the_slow_lane_and_m_slow_runs_it():
    """pyproject's addopts deselect `slow` by default; `-m slow` (a later -m) selects exactly those."""
    default = _pytest("--collect-only", "-q", "tests/faults/test_fault_catalog.py")
    slow = _pytest("--collect-only", "-q", "-m", "slow", "tests/faults/test_fault_catalog.py")
    assert default.returncode == 0 and slow.returncode == 0, default.stderr + slow.stderr
    chosen = {line for line in default.stdout.splitlines() if "::" in line}
    left_out = {line for line in slow.stdout.splitlines() if "::" in line}
    assert chosen and left_out and not chosen & left_out
    assert "test_fault_is_caught_where_it_is[rope-angles-activation-dtype]" in " ".join(chosen)  # a fault of each kind
    slow_names = {line.split("::")[-1] for line in left_out}
    assert {"test_fault_is_caught_where_it_is[softcap-twice]", "test_fault_is_caught_where_it_is[exact-gelu]"} <= slow_names


def test_ci_runs_the_readme_command_first_then_the_slow_lane():
    readme = (ROOT / "README.md").read_text()
    command = "pip install --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple torch==2.13.0 -e '.[test,plot,lint]' && pytest -n 2"
    assert f"```bash\n{command}\n```" in readme
    steps = [line.split(" || ")[0] for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if " || status=1" in line]
    assert steps == [command, "pytest -n 2 -m slow", "bash .ci/xla-lane"]
