"""Concurrent first use of the tiny-checkpoint cache: pytest-xdist workers and parallel CI jobs
start `check` on an empty cache at the same moment; both must pass (one builds, the other waits
for the lock and uses the complete result), and the cache holds exactly one complete entry."""

from __future__ import annotations

import json
import subprocess
import sys

from harness.checkpoint import Checkpoint
from tests.inputs.scenarios import REPO, cli_env


def test_two_first_use_checks_on_one_empty_cache_both_pass(tmp_path):
    cache = tmp_path / "cache"  # does not exist yet: the first use creates it
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8]]))
    env = cli_env(GEMMA_PARITY_CACHE=str(cache), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "harness.cli", "check", "--model", "tiny", "--prompts",
                               str(prompts), "--new-tokens", "2", "--json", str(tmp_path / f"check{k}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for k in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
        assert "PARITY PASS" in out
    for k in range(2):
        assert json.loads((tmp_path / f"check{k}.json").read_text())["passed"] is True
    entries = [p for p in cache.iterdir() if not p.name.startswith(".lock-")]
    assert len(entries) == 1 and entries[0].name.startswith("tiny-"), sorted(p.name for p in cache.iterdir())
    Checkpoint.open(entries[0])  # complete and valid
