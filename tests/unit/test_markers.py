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


def readme_commands() -> list[str]:
    """The README's two set-up commands: the one-line bash blocks that start with `pip install`."""
    import re

    return re.findall(r"```bash\n(pip install [^\n]*)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_command_first_then_the_xla_lanes_parallel_part():
    run, test = readme_commands()
    assert run.endswith(" && gemma-parity check") and test.endswith(" && pytest -n 2")
    assert run.split(" -e ")[0] == test.split(" -e ")[0]  # the same install, the test extras beside
    steps = [line.split(" || ")[0] for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if " || status=1" in line]
    assert steps == [test, "XLA_LANE_PART=parallel bash .ci/xla-lane"]
    lane = (ROOT / ".ci" / "xla-lane").read_text()
    assert '"${XLA_LANE_PART:-all}" != parallel' in lane  # the part CI leaves out is still the lane's default


def test_the_install_fails_fast_where_pytorchs_index_is_unreachable():
    """pip retries an unreachable index five times per package (about 9 minutes for the test command
    in a new environment, docs/ci.md); --retries 0 goes on at once. PyPI stays pip's default index, so
    the commands name only PyTorch's (as --extra-index-url: its 2.13.0+cpu outranks PyPI's 2.13.0)."""
    for command in readme_commands():
        words = command.split(" && ")[0].split()
        assert words[words.index("--retries") + 1] == "0"
        assert "--index-url" not in words and words.count("--extra-index-url") == 1
        assert "torch==2.13.0" in words
    workflows = {p.name: p.read_text() for p in (ROOT / ".github" / "workflows").glob("*.yml")}
    install = readme_commands()[1].split(" && ")[0]
    assert install in workflows["pr.yml"] and install in workflows["nightly.yml"]


# Hosts of package registries: pip needs no URL for its default index, and the project names none.
REGISTRY_HOSTS = ("pypi" + ".org", "files.python" + "hosted.org", "test.pypi" + ".org")


def test_no_package_registry_host_is_named():
    files = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / ".ci" / "run",
             *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / ".github").rglob("*.yml")),
             *sorted((ROOT / "harness").rglob("*.py"))]
    named = [(str(p.relative_to(ROOT)), host) for p in files if p.is_file()
             for host in REGISTRY_HOSTS if host in p.read_text(encoding="utf-8").lower()]
    assert named == []
