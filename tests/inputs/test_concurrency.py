"""Concurrent first use of the tiny-checkpoint cache: pytest-xdist workers and parallel CI jobs
start `check` on an empty cache at the same moment; both must pass (one builds, the other waits
for the lock and uses the complete result), and the cache holds exactly one complete entry."""

from __future__ import annotations

import json
import subprocess
import sys

from harness.inputs.checkpoint import Checkpoint
import pytest

from tests.inputs.scenarios import REPO, cli_env


@pytest.mark.slow  # two whole checks; the lock itself is tested below in the default lane
def test_two_first_use_checks_on_one_empty_cache_both_pass(tmp_path):
    cache = tmp_path / "cache"  # does not exist yet: the first use creates it
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8]]))
    env = cli_env(GEMMA_PARITY_CACHE=str(cache), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "harness.cli", "check", "--model", "tiny", "--prompts",
                               str(prompts), "--new-tokens", "2", "--json", str(tmp_path / f"check{k}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for k in range(2)]
    outputs = [p.communicate(timeout=1800) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
        assert "PARITY PASS" in out
    for k in range(2):
        assert json.loads((tmp_path / f"check{k}.json").read_text())["passed"] is True
    entries = [p for p in cache.iterdir() if not p.name.startswith(".lock-")]
    assert len(entries) == 1 and entries[0].name.startswith("tiny-"), sorted(p.name for p in cache.iterdir())
    Checkpoint.open(entries[0])  # complete and valid


def test_a_second_builder_waits_for_the_lock_and_takes_the_winners_entry(tmp_path, tiny0_dir):
    """Deterministically, the protocol under the race: while another builder holds the entry's lock
    a first use waits (builds nothing); when the winner's complete entry appears and the lock is
    released, it returns that entry untouched instead of refusing or rebuilding."""
    import fcntl
    import os
    import shutil
    import time

    from tests.inputs.scenarios import snapshot

    cache = tmp_path / "cache"
    cache.mkdir()
    env = cli_env(GEMMA_PARITY_CACHE=str(cache))
    name = subprocess.run([sys.executable, "-c", "from harness.inputs.tiny import tiny_checkpoint_path as p; "
                           "print(p(0).name)"], capture_output=True, text=True, env=env, check=True).stdout.strip()
    with open(cache / f".lock-{name}", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", "from harness.inputs.tiny import tiny_checkpoint; "
                                 "print(tiny_checkpoint(0))"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        time.sleep(4)
        assert proc.poll() is None, proc.communicate()
        assert sorted(p.name for p in cache.iterdir()) == [f".lock-{name}"]  # nothing built meanwhile
        staging = cache / ".staging"
        shutil.copytree(tiny0_dir, staging)
        os.rename(staging, cache / name)  # the winner's entry appears by one rename
        before = snapshot(cache / name)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    assert out.strip() == str(cache / name)
    assert snapshot(cache / name) == before
