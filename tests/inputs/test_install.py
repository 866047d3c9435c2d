"""A non-editable install (`pip install .`) works like the checkout: the wheel carries fixtures/ (the
tiny model's config, the default prompts) inside the package and installs the guarded console
script, and `gemma-parity check` runs from it. The wheel is built from a copy of the sources, so
the checkout gets no build/ or *.egg-info."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.inputs.scenarios import REPO

SOURCES = ("harness", "fixtures", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


def build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                          if (REPO / name).is_dir() else {}))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True, text=True, cwd=tmp_path)
    return next(out.glob("gemma_parity-*.whl"))


def test_the_wheel_carries_the_fixtures_and_the_guarded_entry_point(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for fixture in (REPO / "fixtures").rglob("*.json"):
        if fixture.relative_to(REPO / "fixtures").parts[0].startswith("goldens-"):
            continue  # the reference-drift goldens are the tests' own (setup.py leaves them out)
        assert f"harness/fixtures/{fixture.relative_to(REPO / 'fixtures')}" in names, fixture
    assert "gemma-parity = harness.entry:main" in entry_points


@pytest.mark.slow  # builds a wheel, a venv, and runs the full default check (about a minute on two cores)
def test_a_non_editable_install_runs_check(tmp_path):
    """pip install of the built wheel into a fresh venv that sees this machine's torch and
    transformers (--no-deps; --ignore-installed, as the machine may have an editable install of the
    checkout), then `gemma-parity check` from a directory outside the checkout and without
    PYTHONPATH: the installed package, with its own fixtures, passes."""
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", str(wheel)], check=True,
                   capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_XDIST_WORKER")}
    where = subprocess.run([str(python), "-c", "import harness; print(harness.FIXTURES_DIR)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, check=True).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, with its own fixtures
    proc = subprocess.run([str(venv / "bin" / "gemma-parity"), "check", "--model", "tiny"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PARITY PASS" in proc.stdout
