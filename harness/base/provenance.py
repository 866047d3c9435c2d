"""Provenance of a result file: what produced it, so that a history blames the right commit and a
comparison knows when its two sides ran under different settings or versions.

One home for the decision (docs/ci.md#owned-outputs lists the files that carry it): the run
settings in full, the sha256 of every input the result depends on (checkpoint files, golden,
prompts, corpus), the versions of python, torch, transformers and the Neuron SDK packages where
installed, and the git commit of the tree with a dirty flag (uncommitted changes to tracked files).
`differences` names what differs between two provenance blocks, for the warnings of `perf compare`
and `check --golden`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "safetensors", "torch-neuronx", "neuronx-distributed", "neuronx-cc",
            "libneuronxla", "torch-xla")
# what must agree for two results to be compared without a warning
COMPARED = ("settings", "packages", "inputs")
# Command-line options that say where results go or whether one may be replaced, not how they were
# computed: recorded with the settings, never reported as a difference between two runs.
OUTPUT_OPTIONS = frozenset({"out", "json", "report", "markdown", "plot", "history", "force", "overwrite"})


def package_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def git_state(repo=None) -> dict:
    """{"commit": sha or "unknown", "dirty": bool or None}: None when there is no git tree. Only a
    checkout whose top level is `repo` itself counts: a source archive unpacked inside some other
    repository has no commit of its own (it must not record the outer one's)."""
    repo = Path(repo or Path(__file__).resolve().parents[2])
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=repo, capture_output=True, text=True,
                             timeout=10)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != repo.resolve():
            raise OSError(top.stderr or f"{repo} is not the top of a git checkout")
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            raise OSError(head.stderr)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, timeout=30)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": os.environ.get("GITHUB_SHA", "unknown"), "dirty": None}


def file_sha256(path) -> str | None:
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    except OSError:
        return None


def provenance(settings: dict | None = None, inputs: dict | None = None) -> dict:
    """The block every result file carries under "provenance"."""
    return {"settings": settings or {}, "inputs": inputs or {}, "packages": package_versions(), "git": git_state()}


def differences(a: dict | None, b: dict | None) -> list[str]:
    """What differs between two provenance blocks, one entry per key ('packages.torch: 2.9.0 vs 2.13.0')."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return []
    out = []
    for section in COMPARED:
        left, right = a.get(section), b.get(section)
        if not isinstance(left, dict) or not isinstance(right, dict):
            continue
        for key in sorted(set(left) | set(right)):
            if section == "settings" and key in OUTPUT_OPTIONS:
                continue
            if left.get(key) != right.get(key):
                out.append(f"{section}.{key}: {str(left.get(key))[:40]} vs {str(right.get(key))[:40]}")
    return out
