"""`quality --shard auto` under each scheduler's array-index variables, and `merge`: shards written as
separate runs (separate golden directories, as on separate machines) merge into a golden whose
judged result equals the one-process run's exactly; missing, duplicated and mismatched shards are
refused."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.base.array_index import shard_from_environment
from harness.base.errors import OptionError
from harness.cli import main

SCHEDULER_VARS = ("AWS_BATCH_JOB_ARRAY_INDEX", "JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN",
                  "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_STEP")


@pytest.mark.parametrize("text, env, existing, expected", [
    ("auto/4", {"AWS_BATCH_JOB_ARRAY_INDEX": "2"}, None, (2, 4)),
    ("auto/3", {"JOB_COMPLETION_INDEX": "0"}, None, (0, 3)),
    ("auto", {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "4"}, None, (2, 4)),
    ("auto", {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "3",
              "SLURM_ARRAY_TASK_STEP": "2"}, None, (2, 3)),
    ("auto", {"AWS_BATCH_JOB_ARRAY_INDEX": "1"}, 2, (1, 2)),  # the count from an existing golden
    ("auto/2", {"AWS_BATCH_JOB_ARRAY_INDEX": "1", "JOB_COMPLETION_INDEX": "1"}, 2, (1, 2)),  # agreeing
])
def test_shard_auto_reads_each_schedulers_index(text, env, existing, expected):
    assert shard_from_environment(text, env, existing) == expected


@pytest.mark.parametrize("text, env, existing, fragment", [
    ("auto", {}, None, "no array-job index"),
    ("auto", {"AWS_BATCH_JOB_ARRAY_INDEX": "1"}, None, "give it: --shard auto/N"),
    ("auto", {"JOB_COMPLETION_INDEX": "1"}, None, "give it: --shard auto/N"),
    ("auto/2", {"AWS_BATCH_JOB_ARRAY_INDEX": "2"}, None, "need 0 <= index < N"),
    ("auto/2", {"AWS_BATCH_JOB_ARRAY_INDEX": "١"}, None, "not a plain array index"),
    ("auto/2", {"AWS_BATCH_JOB_ARRAY_INDEX": "-1"}, None, "not a plain array index"),
    ("auto/2", {"AWS_BATCH_JOB_ARRAY_INDEX": "0", "JOB_COMPLETION_INDEX": "1"}, None, "disagree"),
    ("auto/3", {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4"}, None, "says 4 shards, not 3"),
    ("auto/3", {"AWS_BATCH_JOB_ARRAY_INDEX": "0"}, 2, "says 2 shards, not 3"),
    ("auto/x", {"AWS_BATCH_JOB_ARRAY_INDEX": "0"}, None, "whole number"),
    ("auto/0", {"AWS_BATCH_JOB_ARRAY_INDEX": "0"}, None, "need 0 <= index < N"),
])
def test_shard_auto_refuses_what_it_cannot_trust(text, env, existing, fragment):
    with pytest.raises(OptionError, match=fragment.replace("(", r"\(").replace("+", r"\+")):
        shard_from_environment(text, env, existing)


WINDOW, CORPUS_IDS = 16, 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from harness import FIXTURES_DIR

    path = tmp_path_factory.mktemp("corpus") / "corpus.json"
    path.write_text(json.dumps(json.loads((FIXTURES_DIR / "corpus" / "tiny-20k.json").read_text())[:CORPUS_IDS]))
    return path


def quality(tiny0_dir, corpus, golden, *extra) -> int:
    return main(["quality", "--checkpoint", str(tiny0_dir), "--corpus", str(corpus), "--golden", str(golden),
                 "--window", str(WINDOW), "--windows-per-part", "1", *map(str, extra)])


@pytest.fixture(scope="module")
def machines(tmp_path_factory, tiny0_dir, corpus):
    """Two shard runs, each in its own directory, under AWS Batch and Kubernetes variables."""
    root = tmp_path_factory.mktemp("machines")
    mp = pytest.MonkeyPatch()
    try:
        for var in SCHEDULER_VARS:
            mp.delenv(var, raising=False)
        for k, (var, name) in enumerate((("AWS_BATCH_JOB_ARRAY_INDEX", "batch"), ("JOB_COMPLETION_INDEX", "k8s"))):
            mp.setenv(var, str(k))
            assert quality(tiny0_dir, corpus, root / name, "--shard", "auto/2") == 0
            mp.delenv(var)
    finally:
        mp.undo()
    return root


def test_shards_from_two_machines_merge_to_the_one_process_result(tmp_path, tiny0_dir, corpus, machines, capsys):
    from harness.quality.golden import shard_dir

    assert sorted(p.name for p in (machines / "batch").iterdir()) == ["quality-golden.json", "shard-000-of-002"]
    assert sorted(p.name for p in (machines / "k8s").iterdir()) == ["quality-golden.json", "shard-001-of-002"]
    assert main(["merge", str(machines / "batch"), str(machines / "k8s"), "--out", str(tmp_path / "merged")]) == 0
    assert shard_dir(tmp_path / "merged", 1, 2).is_dir()
    assert quality(tiny0_dir, corpus, tmp_path / "merged", "--json", tmp_path / "merged.json") == 0
    assert quality(tiny0_dir, corpus, tmp_path / "one", "--json", tmp_path / "one.json") == 0  # one process, 1 shard
    merged, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("merged", "one"))
    for key in ("port", "bf16_reference", "verdict", "worst_positions"):
        assert merged[key] == one[key], key
    assert merged["port"]["positions"] == CORPUS_IDS // WINDOW * (WINDOW - 1)


def test_merge_refuses_missing_duplicated_and_mismatched_shards(tmp_path, tiny0_dir, corpus, machines, capsys):
    out = str(tmp_path / "merged")
    assert main(["merge", str(machines / "batch"), "--out", out]) == 2
    assert "shards [1] of 2 are in none of the sources" in capsys.readouterr().err
    twin = shutil.copytree(machines / "batch", tmp_path / "batch-again")
    assert main(["merge", str(machines / "batch"), str(twin), str(machines / "k8s"), "--out", out]) == 2
    assert "shard 0 of 2 is in both" in capsys.readouterr().err
    other = shutil.copytree(machines / "k8s", tmp_path / "other")
    settings = json.loads((other / "quality-golden.json").read_text())
    (other / "quality-golden.json").write_text(json.dumps({**settings, "corpus_sha256": "0" * 64}))
    assert main(["merge", str(machines / "batch"), str(other), "--out", out]) == 2
    assert "corpus_sha256 differ" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    assert main(["merge", str(machines / "batch"), str(machines / "k8s"), "--out", str(tmp_path / "full")]) == 2
    assert "never replaces" in capsys.readouterr().err and not (tmp_path / "merged").exists()
