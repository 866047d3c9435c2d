"""Running a bundle's check.sh as a compiler engineer would: a fresh shell, a PYTHONPATH where this
package, transformers and torch cannot be imported (each a package that raises on import), jax from
GEMMA_PARITY_JAX_PATH (the XLA lane installs it apart from its venv) when given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BLOCKED = ("harness", "transformers", "torch", "safetensors")


def blocker_dir(tmp: Path) -> Path:
    root = tmp / "blocked"
    for name in BLOCKED:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(f"raise ImportError('an HLO bundle must not import {name}')\n")
    return root


def run_check(bundle: Path, tmp: Path, *args: str, extra_path: str | None = None) -> subprocess.CompletedProcess:
    """`sh BUNDLE/check.sh ARGS` from `tmp`, with only the bundle's own dependencies importable."""
    paths = [str(blocker_dir(tmp))] + [p for p in (os.environ.get("GEMMA_PARITY_JAX_PATH"), extra_path) if p]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GEMMA_PARITY_JAX_PATH")}
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHON=sys.executable)
    return subprocess.run(["sh", str(bundle / "check.sh"), *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=900)


def jax_available() -> bool:
    from importlib.util import find_spec

    return bool(os.environ.get("GEMMA_PARITY_JAX_PATH")) or find_spec("jax") is not None
