"""The exit-code contract and the promises about the user's files, beyond single refusals:
internal errors are not parity failures (70, traceback in a file), OS errors name the user's path
(2), Ctrl-C and SIGTERM exit 130/143 with one line, what transformers ignores is ignored, a golden
is replaced only whole and only when it is one, leftovers of killed runs are cleaned (never a live
run's), and files get normal permissions."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import harness.base.atomic
import harness.inputs.checkpoint
import harness.inputs.weight_files
from harness.base.atomic import TEMP_MARK, atomic_directory, temp_prefix
from harness.base.leftovers import clean_stale_temps
from tests.inputs.scenarios import (REPO, TEXT, WEIGHTS, cli_env, copy_checkpoint, rewrite_weights,
                                    run_inprocess, small_golden, snapshot, split_weights)


@pytest.fixture(scope="module")
def shared_golden(tmp_path_factory, tiny0_ckpt):
    return small_golden(tmp_path_factory.mktemp("contract") / "golden", tiny0_ckpt)


# ---- internal errors and OS errors ---------------------------------------------------------------

def test_an_internal_error_exits_70_with_the_traceback_in_a_file(tmp_path, monkeypatch, capsys):
    """A bug (here: plan_summary raising ZeroDivisionError) is reported as an internal error with
    exit 70, never 1 (which CI reads as a parity failure), and the traceback is kept in a file."""
    import harness.port.sharding

    def broken(*args, **kwargs):
        return 1 / 0

    monkeypatch.setattr(harness.port.sharding, "plan_summary", broken)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    outcome = run_inprocess(["info", "--model", "tiny"], capsys)
    assert outcome.code == 70
    assert "internal error" in outcome.err and "ZeroDivisionError" in outcome.err
    crash = [p for p in tmp_path.iterdir() if p.name.startswith("gemma-parity-crash-")]
    assert len(crash) == 1 and str(crash[0]) in outcome.err
    assert "ZeroDivisionError" in crash[0].read_text() and "Traceback" in crash[0].read_text()


def test_a_full_disk_exits_2_naming_the_users_path(tmp_path, monkeypatch, capsys):
    """ENOSPC while writing --json: exit 2, the user's path (not a temp name, not None) and what
    to do, and no temp file left behind."""
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(harness.base.atomic.os, "fsync", full)
    out = tmp_path / "info.json"
    outcome = run_inprocess(["info", "--model", "tiny", "--json", out], capsys)
    assert outcome.code == 2
    assert f"{out}: cannot write (No space left on device): the disk is full" in outcome.err
    assert TEMP_MARK not in outcome.err and "None" not in outcome.err
    assert list(tmp_path.iterdir()) == []



class _SafetensorsDiskFull(Exception):
    """What safetensors' Rust writer raises on a full disk (its own type, not an OSError)."""


def _tensors_disk_full(tensors, filename, *args, **kwargs):
    Path(filename).write_bytes(b"half a tensor file")  # what a full disk leaves: a partial file
    raise _SafetensorsDiskFull("Error while serializing: I/O error: No space left on device (os error 28)")


def _manifest_disk_full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["golden-tensors", "golden-manifest", "tiny-cache"])
def test_a_full_disk_while_writing_a_golden_or_the_cache_is_exit_2_with_nothing_half_written(
        tmp_path, monkeypatch, capsys, where):
    """ENOSPC in each writer of big files (safetensors' own error type included): exit 2 naming
    the user's location and that the disk is full, no traceback, and no partial file or temp
    directory left behind."""
    import harness.inputs.sealed

    prompts = tmp_path / "p.json"
    prompts.write_text("[[5, 6, 7]]")
    out = tmp_path / "golden"
    argv = ["reference", "--model", "tiny", "--prompts", prompts, "--new-tokens", 1, "--out", out]
    if where == "golden-tensors":
        monkeypatch.setattr(harness.inputs.sealed, "save_file", _tensors_disk_full)
    elif where == "golden-manifest":
        monkeypatch.setattr(harness.inputs.sealed.os, "fsync", _manifest_disk_full)
    else:
        monkeypatch.setenv("GEMMA_PARITY_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr("transformers.modeling_utils.safe_save_file", _tensors_disk_full)
        argv = ["info", "--model", "tiny"]
        out = tmp_path / "cache"
    before = snapshot(tmp_path)
    outcome = run_inprocess(argv, capsys)
    assert outcome.code == 2, outcome.err
    assert f"{out}" in outcome.err and "the disk is full" in outcome.err, outcome.err
    assert "Traceback" not in outcome.err and "internal error" not in outcome.err
    left = {k: v for k, v in snapshot(tmp_path).items() if k not in before and not Path(k).name.startswith(".lock-")}
    assert set(left) <= {str(tmp_path / "cache")}, left  # the cache directory itself may be created

def test_permission_denied_on_a_shard_is_not_called_corruption(tmp_path, tiny0_dir, monkeypatch, capsys):
    """An unreadable shard (simulated: the tests run as root) is reported as a permission problem,
    never as 'truncated or corrupted, download it again'."""
    ckpt = copy_checkpoint(tiny0_dir, tmp_path / "ckpt")
    real_open = open

    def guarded(file, *args, **kwargs):
        if str(file).endswith(WEIGHTS):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(harness.inputs.weight_files, "open", guarded, raising=False)
    outcome = run_inprocess(["info", "--checkpoint", ckpt], capsys)
    assert outcome.code == 2
    assert f"{ckpt / WEIGHTS}: cannot read the safetensors file: permission denied" in outcome.err
    assert "corrupted" not in outcome.err and "download" not in outcome.err


def test_permission_denied_on_the_prompts_file(tmp_path, tiny0_dir, monkeypatch, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[1, 2]]")
    real = Path.read_bytes

    def guarded(self):
        if self == prompts:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", guarded)
    outcome = run_inprocess(["check", "--checkpoint", tiny0_dir, "--prompts", prompts], capsys)
    assert outcome.code == 2 and f"{prompts}: cannot read the prompts file: permission denied" in outcome.err


# ---- signals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130),
                                       pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)])  # same path
def test_interrupt_exits_with_one_line_and_leaves_no_temp(tmp_path, tiny0_dir, sig, code):
    """Ctrl-C (or a CI timeout's SIGTERM) during the reference: one line, exit 130 (143), no
    traceback, and no half-written golden or temp directory."""
    out = tmp_path / "golden"
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "reference", "--checkpoint", str(tiny0_dir),
                             "--new-tokens", "200", "--out", str(out)], stderr=subprocess.PIPE, text=True,
                            env={**cli_env(), "GEMMA_PARITY_PROGRESS": "1"})  # progress lines without a TTY
    seen = ""
    while "[reference" not in seen:  # the model work has started
        line = proc.stderr.readline()
        assert line, f"the command ended before the reference started: {seen}"
        seen += line
    proc.send_signal(sig)
    rest = proc.communicate(timeout=900)[1]
    assert proc.returncode == code, seen + rest
    tail = [line for line in rest.splitlines() if line.startswith("gemma-parity")]
    assert len(tail) == 1 and ("interrupted" in tail[0] or "terminated" in tail[0]), rest
    assert "Traceback" not in rest
    assert list(tmp_path.iterdir()) == []


# ---- what transformers loads ---------------------------------------------------------------------

def test_a_stray_shard_beside_model_safetensors_is_ignored_like_transformers(tmp_path, tiny0_dir, capsys):
    """transformers loads model.safetensors and nothing else when it exists: a stray extra shard
    (here one that would redefine a weight) is neither read nor reported as a port bug."""
    ckpt = copy_checkpoint(tiny0_dir, tmp_path / "ckpt")
    from safetensors.torch import save_file

    save_file({f"{TEXT}norm.weight": torch.full((64,), float("nan"))}, str(ckpt / "extra.safetensors"))
    outcome = run_inprocess(["info", "--checkpoint", ckpt], capsys)
    assert outcome.code == 0, outcome.err
    assert "not loaded (transformers does not load them either): extra.safetensors" in outcome.out
    opened = harness.inputs.checkpoint.Checkpoint.open(ckpt)
    assert set(opened.key_to_file.values()) == {ckpt / WEIGHTS}
    assert bool(torch.isfinite(opened.final_norm_weight()).all())


def test_an_index_with_its_shards_is_read_and_agrees_with_the_single_file(tmp_path, tiny0_dir):
    """A correctly sharded checkpoint (index + two shards) maps every key to the shard holding it
    and reads the same tensors as the single file."""
    single = harness.inputs.checkpoint.Checkpoint.open(tiny0_dir)
    ckpt = copy_checkpoint(tiny0_dir, tmp_path / "ckpt")
    first, second = split_weights(ckpt, f"{TEXT}layers.3.")
    sharded = harness.inputs.checkpoint.Checkpoint.open(ckpt)
    assert {k: v.name for k, v in sharded.key_to_file.items()} == {
        k: (second if k.startswith(f"{TEXT}layers.3.") else first) for k in single.key_to_file}
    assert torch.equal(sharded.layer_weights(3)["mlp.up_proj.weight"], single.layer_weights(3)["mlp.up_proj.weight"])


def test_bisect_accepts_a_golden_of_other_weights(tmp_path, tiny0_dir, shared_golden):
    """check refuses a golden of other weights; bisect's validation accepts it (yesterday's golden
    against today's weights is what bisect is for) and records that the weights differ."""
    from harness.cli import build_parser

    ckpt = rewrite_weights(copy_checkpoint(tiny0_dir, tmp_path / "ckpt"), lambda t: t[f"{TEXT}norm.weight"].mul_(2))
    args = build_parser().parse_args(["bisect", "--checkpoint", str(ckpt), "--golden", str(shared_golden)])
    args.validate(args)
    assert args.golden_same_weights is False
    args = build_parser().parse_args(["bisect", "--checkpoint", str(tiny0_dir), "--golden", str(shared_golden)])
    args.validate(args)
    assert args.golden_same_weights is True


def test_a_prompts_file_with_a_byte_order_mark_is_read(tmp_path):
    from harness.inputs.prompts import load_prompts

    path = tmp_path / "prompts.json"
    path.write_bytes("\ufeff[[5, 6, 7]]".encode("utf-8"))
    assert load_prompts(path) == [[5, 6, 7]]


# ---- replacing a golden --------------------------------------------------------------------------

def test_overwrite_replaces_a_golden_whole(tmp_path, tiny0_dir, shared_golden, capsys):
    """--overwrite over a golden this tool wrote: the new golden (other prompts) replaces it, with
    normal permissions, and nothing else appears beside it."""
    import shutil

    from harness.reference.golden import read_golden

    target = Path(shutil.copytree(shared_golden, tmp_path / "golden"))
    prompts = tmp_path / "p.json"
    prompts.write_text("[[9, 10]]")
    old_umask = os.umask(0o022)
    try:
        outcome = run_inprocess(["reference", "--checkpoint", tiny0_dir, "--prompts", prompts, "--new-tokens", 1,
                                 "--out", target, "--overwrite"], capsys)
    finally:
        os.umask(old_umask)
    assert outcome.code == 0, outcome.err
    assert read_golden(target).prompts == [[9, 10]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden", "p.json"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()} == {0o644}


def test_the_old_directory_stays_until_the_new_one_is_complete(tmp_path):
    """While the new directory is being written the old one is whole; a failure keeps it; success
    swaps it out in one step."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(target, replace=True) as tmp:
            (tmp / "a").write_text("new")
            assert (target / "a").read_text() == "old"
            raise RuntimeError("killed half way")
    assert (target / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_directory(target, replace=True) as tmp:
        (tmp / "a").write_text("new")
        assert (target / "a").read_text() == "old"
    assert (target / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- leftovers of killed runs --------------------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _temp(directory: Path, name: str, pid: int, host: str | None = None, age_s: float = 0,
          suffix: str = "abc123") -> Path:
    prefix = temp_prefix(name).replace(f".{os.getpid()}@", f".{pid}@")
    if host:
        prefix = prefix.rsplit("@", 1)[0] + f"@{host}."
    path = directory / f"{prefix}{suffix}"
    path.mkdir()
    (path / "tensors.safetensors").write_bytes(b"half")
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_stale_temps_are_removed_and_live_ones_kept(tmp_path, capsys):
    """The next run removes a temp whose writer is dead (or, from another host, older than a day);
    a live run's temp and a fresh one from another host are kept, and so is everything else."""
    dead = _temp(tmp_path, "golden", _dead_pid())
    live_writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _temp(tmp_path, "golden", live_writer.pid)
        other_fresh = _temp(tmp_path, "golden", 1234, host="0badc0de")
        other_old = _temp(tmp_path, "golden", 1234, host="0badc0de", age_s=3 * 86400, suffix="def456")
        users = tmp_path / "partial-notes.txt"
        users.write_text("not ours")
        lookalike = tmp_path / ".partial-notes.markdown"  # starts like a temp, but has no writer tag
        lookalike.write_text("the user's")
        os.utime(lookalike, (time.time() - 9 * 86400, time.time() - 9 * 86400))
        outcome = run_inprocess(["info", "--model", "tiny", "--json", tmp_path / "info.json"], capsys)
        assert outcome.code == 0, outcome.err
        assert not dead.exists() and not other_old.exists()
        assert live.exists() and other_fresh.exists() and users.exists() and lookalike.exists()
        assert f"removed {dead}" in outcome.err
    finally:
        live_writer.kill()
        live_writer.wait()


def test_a_kill_between_the_two_renames_is_repaired(tmp_path):
    """Without an atomic exchange the old golden is moved aside before the new one is renamed in;
    if a kill lands in between, the next run puts the old golden back rather than deleting it."""
    aside = _temp(tmp_path, "golden", _dead_pid())
    (aside / "tensors.safetensors").unlink()
    aside = aside.rename(tmp_path / aside.name.replace(".partial-golden.", ".partial-golden.old."))
    (aside / "previous").mkdir()
    (aside / "previous" / "manifest.json").write_text("{}")
    (aside / "TARGET").write_text("golden")
    done = clean_stale_temps(tmp_path)
    assert done == [f"restored {tmp_path / 'golden'} (a run was killed while replacing it)"]
    assert (tmp_path / "golden" / "manifest.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden"]


def test_written_files_have_normal_permissions(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        outcome = run_inprocess(["info", "--model", "tiny", "--json", tmp_path / "sub" / "info.json"], capsys)
    finally:
        os.umask(old)
    assert outcome.code == 0
    assert stat.S_IMODE((tmp_path / "sub" / "info.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "sub").stat().st_mode) == 0o755
    payload = json.loads((tmp_path / "sub" / "info.json").read_text())
    assert payload["generator"].startswith("gemma-parity info")


def test_a_result_this_tool_wrote_is_replaced(tmp_path, capsys):
    """--json over the previous run's result is allowed (results are rewritten each run)."""
    out = tmp_path / "info.json"
    assert run_inprocess(["info", "--model", "tiny", "--json", out, "--tp", 1], capsys).code == 0
    first = json.loads(out.read_text())
    assert run_inprocess(["info", "--model", "tiny", "--json", out, "--tp", 2], capsys).code == 0
    assert json.loads(out.read_text())["tp"] == 2 != first["tp"]


def test_refusals_need_no_model_work_even_for_a_huge_decode(tmp_path, tiny0_dir):
    """The issue's slowest case, end to end in a fresh process: --new-tokens 1000000 used to decode
    for many minutes before being refused; now the refusal comes before any model work (counted in
    the child by tests/model_work.py: no weight read, no model loaded, no forward) and names the fix."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([list(range(3, 63))]))
    log = tmp_path.parent / f"{tmp_path.name}-work.log"
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tests.model_work", str(log), "check", "--checkpoint",
                           str(tiny0_dir), "--prompts", str(prompts), "--new-tokens", "1000000", "--json",
                           str(tmp_path / "c.json")], capture_output=True, text=True, timeout=600,
                          env=cli_env(), cwd=REPO)
    assert proc.returncode == 2 and "--kv-len" in proc.stderr and str(prompts) in proc.stderr, proc.stderr
    assert log.read_text() == "", f"refused only after model work: {log.read_text()}"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where, fragment", [("/sys/gemma-parity-cache", "/sys/gemma-parity-cache: cannot use the "
                                              "tiny-model cache"),
                                             ("FILE", "the tiny-model cache is not a directory")])
def test_an_unusable_cache_location_is_an_environment_error(tmp_path, monkeypatch, capsys, where, fragment):
    """GEMMA_PARITY_CACHE on a read-only or non-directory location: exit 2 naming it and the
    variable, nothing created."""
    if where == "FILE":
        where = str(tmp_path / "file")
        Path(where).write_text("x")
        fragment = f"{where}: {fragment}"
    monkeypatch.setenv("GEMMA_PARITY_CACHE", where)
    before = snapshot(tmp_path)
    outcome = run_inprocess(["info", "--model", "tiny"], capsys)
    assert outcome.code == 2 and fragment in outcome.err and "GEMMA_PARITY_CACHE" in outcome.err
    assert snapshot(tmp_path) == before


def test_an_empty_cache_variable_means_the_default(monkeypatch):
    from harness.inputs.tiny import cache_dir

    monkeypatch.setenv("GEMMA_PARITY_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "gemma-parity"


def test_a_write_that_fails_after_the_check_is_exit_2_and_no_verdict(tmp_path, tiny0_dir, shared_golden,
                                                                     monkeypatch, capsys):
    """The disk fills up while `check` writes --json after a passing run: exit 2 naming the path,
    and no "PARITY PASS" printed before it (CI must never see a verdict followed by a failure)."""
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(harness.base.atomic.os, "fsync", full)
    out = tmp_path / "check.json"
    outcome = run_inprocess(["check", "--checkpoint", tiny0_dir, "--golden", shared_golden, "--json", out], capsys)
    assert outcome.code == 2, outcome.err
    assert f"{out}: cannot write (No space left on device)" in outcome.err
    assert "PARITY" not in outcome.out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "move-aside"])
def test_replace_swaps_in_the_new_directory_either_way(tmp_path, monkeypatch, exchange):
    """With the kernel's atomic exchange, and without it (move aside, rename in): the new content
    replaces the old, and nothing is left beside it."""
    if not exchange:
        monkeypatch.setattr(harness.base.atomic, "_exchange", lambda a, b: False)
    target = tmp_path / "out"
    target.mkdir()
    (target / "old-only").write_text("old")
    with atomic_directory(target, replace=True) as tmp:
        (tmp / "new-only").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new-only"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("command", ["reference", "bench"])
def test_a_second_run_for_the_same_new_output_is_refused_before_its_work(tmp_path, monkeypatch, capsys, command):
    """While one run holds the claim on a new --out (here: this test, through the same lock a run
    takes), a second run for the same --out is refused at validation (exit 2, naming it), without
    loading a model or computing anything, and leaves the disk as it was; once released, the
    claim file is gone and the output can be claimed again."""
    import harness.reference.run
    from harness.base.atomic import _claim_file

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started although the output was claimed by another run")

    monkeypatch.setattr(harness.reference.run, "run_reference", no_model_work)
    monkeypatch.setattr("harness.cli.perf.run_bench", no_model_work)
    out = tmp_path / ("golden" if command == "reference" else "bench.json")
    harness.base.atomic.claim_output(out, "--out")  # another run's claim (a second open file: flock conflicts)
    claimed = _claim_file(out)
    fd, path = harness.base.atomic._claims.pop()  # keep holding it, outside this process's own release
    try:
        before = snapshot(tmp_path)
        argv = (["reference", "--model", "tiny", "--new-tokens", 1, "--out", out] if command == "reference"
                else ["bench", "--model", "tiny", "--runs", 1, "--warmup", 0, "--new-tokens", 1, "--out", out])
        outcome = run_inprocess(argv, capsys)
        assert outcome.code == 2, outcome.err
        assert f"--out {out}: another gemma-parity run is writing it right now" in outcome.err
        assert snapshot(tmp_path) == before
    finally:
        harness.base.atomic._claims.append((fd, path))
        harness.base.atomic.release_claims()
    assert not claimed.exists()
    harness.base.atomic.claim_output(out, "--out")  # free again
    harness.base.atomic.release_claims()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
