"""Where the bundle's standalone runner (fixtures/bundle/run_hlo.py) gets its CPU XLA: jax and jaxlib, on
this interpreter's path or in the directory GEMMA_PARITY_JAX_PATH names (the XLA lane installs them
there, apart from its venv: torch-xla changes behaviour when jax is importable). The runner is loaded
from a bundle's own copy, so the reducer judges with the bundle's own compare."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from harness.base.errors import HarnessInputError

JAX_PATH_ENV = "GEMMA_PARITY_JAX_PATH"
JAX_VERSION = "0.10.2"  # keep in step with fixtures/bundle/run_hlo.py and .ci/xla-lane


def runner_env() -> dict[str, str]:
    env = dict(os.environ)
    extra = os.environ.get(JAX_PATH_ENV)
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([extra, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def full_text(proto: bytes, workdir: Path) -> str:
    """The module's text with every constant printed (torch-xla elides large ones as {...})."""
    import harness

    path = Path(workdir) / "module.hlo.pb"
    path.write_bytes(proto)
    done = subprocess.run([sys.executable, str(harness.FIXTURES_DIR / "bundle" / "run_hlo.py"), "--print-text",
                           str(path)], capture_output=True, text=True, env=runner_env(), timeout=600)
    if done.returncode != 0:
        raise HarnessInputError(f"printing the HLO module's text needs jax/jaxlib (set {JAX_PATH_ENV} to a "
                                f"directory holding them): {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def load_runner(bundle):
    """The bundle's own run_hlo.py as a module (jax from GEMMA_PARITY_JAX_PATH on the path)."""
    extra = os.environ.get(JAX_PATH_ENV)
    if extra and extra not in sys.path:
        sys.path.insert(0, extra)
    spec = importlib.util.spec_from_file_location("bundle_run_hlo", Path(bundle) / "run_hlo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
