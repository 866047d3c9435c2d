"""Building blocks of the bad-input suite: a snapshot of a directory tree (files, sizes, mtimes,
hashes, links), private damaged copies of the tiny checkpoint, goldens, perf results, and a runner
that calls the command in-process or as a subprocess (its wall time is recorded for messages,
never asserted on: tests/model_work.py counts model work instead)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"
TEXT = "model.language_model."


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every entry under the roots: files by (size, mtime_ns, sha256), links by target, dirs by
    presence. Equal snapshots: nothing was added, removed, replaced or modified."""
    state = {}
    for root in roots:
        if not root.exists():
            continue
        for p in sorted([root, *root.rglob("*")]):
            key = str(p)
            if p.is_symlink():
                state[key] = ("link", os.readlink(p))
            elif p.is_file():
                st = p.stat()
                state[key] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            elif p.is_dir():
                state[key] = ("dir",)
    return state


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float


def run_inprocess(argv: list[str], capsys) -> Outcome:
    from harness.cli import main

    capsys.readouterr()
    start = time.monotonic()
    code = main([str(a) for a in argv])
    seconds = time.monotonic() - start
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err, seconds)


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), **extra)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def run_subprocess(argv: list[str], timeout: float = 600, **env: str) -> Outcome:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(**env), cwd=REPO)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


# ---- damaged inputs -----------------------------------------------------------------------------

def copy_checkpoint(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def edit_config(ckpt: Path, edit) -> Path:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return ckpt


def rewrite_weights(ckpt: Path, edit, name: str = WEIGHTS) -> Path:
    tensors = load_file(ckpt / name)
    edit(tensors)
    save_file(tensors, str(ckpt / name), metadata={"format": "pt"})
    return ckpt


def split_weights(ckpt: Path, moved_prefix: str, index: bool = True, duplicate: bool = False) -> tuple[str, str]:
    """Shard model.safetensors in two the way save_pretrained does: keys under `moved_prefix` go to
    the second shard (also kept in the first with `duplicate`); write the index (or not)."""
    tensors = load_file(ckpt / WEIGHTS)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    moved = {k: t for k, t in tensors.items() if k.startswith(moved_prefix)}
    kept = tensors if duplicate else {k: t for k, t in tensors.items() if k not in moved}
    save_file(kept, str(ckpt / first), metadata={"format": "pt"})
    save_file(moved, str(ckpt / second), metadata={"format": "pt"})
    (ckpt / WEIGHTS).unlink()
    if index:
        weight_map = {k: (second if k in moved else first) for k in tensors}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return first, second


def write_json(path: Path, payload) -> Path:
    path.write_text(json.dumps(payload))
    return path


# ---- goldens ------------------------------------------------------------------------------------

def small_golden(out: Path, ckpt, prompts=((5, 6, 7),), new_tokens: int = 2) -> Path:
    """A real golden of `ckpt` (fp32 and bf16 references) for short prompts."""
    from harness.reference.golden_write import write_golden
    from harness.reference.run import run_reference

    results = run_reference(ckpt.path, [list(p) for p in prompts], new_tokens)
    return write_golden(out, ckpt.spec, results, new_tokens, ckpt.file_hashes(), str(ckpt.path))


def rehash_golden(golden: Path, edit_manifest=None, edit_tensors=None) -> Path:
    """Edit a golden and recompute its hashes, as someone forging a consistent-looking golden
    would: what is left to catch it is the consistency and finiteness checks."""
    from harness.inputs.checkpoint import sha256_file
    from harness.reference.golden import GOLDEN, MANIFEST, TENSORS

    manifest = json.loads((golden / MANIFEST).read_text())
    if edit_tensors:
        tensors = load_file(golden / TENSORS)
        edit_tensors(tensors)
        save_file(tensors, str(golden / TENSORS))
    if edit_manifest:
        edit_manifest(manifest)
    manifest["tensors_sha256"] = sha256_file(golden / TENSORS)
    manifest["golden_sha256"] = GOLDEN.seal(manifest, manifest["tensors_sha256"])
    (golden / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return golden


# ---- perf results -------------------------------------------------------------------------------

def perf_result(prefill=(10.0, 11.0, 10.5), decode=(5.0, 5.1, 5.2)) -> dict:
    return {"format": 1, "machine": {"cpu_model": "test", "neuron_cores": 0}, "spec_hash": "x", "backend": "cpu",
            "tp": 2, "dtype": "bf16", "created": "2026-01-01T00:00:00+00:00", "prefill_bucket": 64,
            "metrics": {"prefill_ms": list(prefill), "decode_ms_per_token": list(decode)},
            "prefill_ms_by_bucket": {"64": list(prefill)}, "git_commit": "abc"}


def tensor_int(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64)
