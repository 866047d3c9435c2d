"""Issue 49's hostile options of the new surfaces, each refused (exit 2) before any model work, no
traceback, nothing written: a snapshot or repro directory inside the user's inputs (the golden, the
checkpoint), a link, a dangling link or the --json file; --compile-budget that is not a finite
number over 0, or given where nothing is budgeted (cpu); a named pipe or a link loop where a
snapshot belongs is called what it is. And the weak ones: `info --config` needs no home directory,
a closed stdout (`info | head -1`) ends the command quietly with 141."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli([str(a) for a in argv])
    except SystemExit as exc:  # argparse's refusal of a value (exit 2, its usage line)
        code = exc.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "internal error" not in out.err, out.err
    return code, out.out, out.err


@pytest.fixture
def no_model_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("model work started")

    for target in ("harness.backends.build_engine", "harness.parity.observe.build_port",
                   "harness.reference.run.run_reference"):
        monkeypatch.setattr(target, refuse)


def _golden(tmp_path) -> Path:
    golden = tmp_path / "golden"
    golden.mkdir()
    return golden


def _inside_golden(tmp_path, ckpt):
    g = _golden(tmp_path)
    return ["check", "--checkpoint", ckpt, "--golden", g, "--snapshot", g / "snap"], "is inside --golden"


def _repro_inside_golden(tmp_path, ckpt):
    g = _golden(tmp_path)
    return ["bisect", "--checkpoint", ckpt, "--golden", g, "--emit-repro", g / "rep"], "is inside --golden"


def _inside_checkpoint(tmp_path, ckpt):
    return ["check", "--checkpoint", ckpt, "--snapshot", Path(ckpt) / "snap"], "is inside --checkpoint"


def _same_as_json(tmp_path, ckpt):
    return (["check", "--checkpoint", ckpt, "--json", tmp_path / "x", "--snapshot", tmp_path / "x"],
            "an output of this run too")


def _symlinked(tmp_path, ckpt):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    return ["check", "--checkpoint", ckpt, "--snapshot", tmp_path / "link"], "is a symbolic link"


def _dangling(tmp_path, ckpt):
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    return ["bisect", "--checkpoint", ckpt, "--golden", _golden(tmp_path), "--emit-repro", tmp_path / "link"], \
        "is a symbolic link"


OUTPUT_CASES = {"snapshot-in-golden": _inside_golden, "repro-in-golden": _repro_inside_golden,
                "snapshot-in-checkpoint": _inside_checkpoint, "snapshot-is-json": _same_as_json,
                "snapshot-symlink": _symlinked, "repro-dangling-symlink": _dangling}


@pytest.mark.parametrize("case", list(OUTPUT_CASES))
def test_a_snapshot_or_repro_where_it_must_not_go_is_refused_first(case, tiny0_dir, tmp_path, no_model_work,
                                                                   capsys):
    argv, fragment = OUTPUT_CASES[case](tmp_path, tiny0_dir)
    before = sorted(p.name for p in Path(tiny0_dir).iterdir())
    code, _, err = _run(capsys, *argv)
    assert code == 2 and fragment in err, err
    assert sorted(p.name for p in Path(tiny0_dir).iterdir()) == before
    assert not (tmp_path / "golden" / "snap").exists() and not (tmp_path / "golden" / "rep").exists()


@pytest.mark.parametrize("command", ["check", "bench"])
@pytest.mark.parametrize("value", ["-1", "nan", "1e999", "0", "inf", "ten"])
def test_compile_budget_must_be_a_finite_number_over_0(command, value, tmp_path, no_model_work, capsys):
    extra = ["--out", tmp_path / "b.json"] if command == "bench" else []
    code, _, err = _run(capsys, command, "--model", "tiny", "--backend", "neuron", f"--compile-budget={value}", *extra)
    assert code == 2 and "--compile-budget" in err and repr(value) in err, err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("command", ["check", "bench"])
def test_compile_budget_on_cpu_is_refused(command, tmp_path, no_model_work, capsys):
    extra = ["--out", tmp_path / "b.json"] if command == "bench" else []
    code, _, err = _run(capsys, command, "--model", "tiny", "--compile-budget", "30", *extra)
    assert code == 2 and "only --backend neuron's cold compile is budgeted" in err, err


def test_a_pipe_or_a_link_loop_in_a_snapshot_is_called_what_it_is(tmp_path, capsys):
    snap = tmp_path / "snap"
    snap.mkdir()
    os.mkfifo(snap / "snapshot.json")
    code, _, err = _run(capsys, "replay", snap)
    assert code == 2 and "is a named pipe" in err, err
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    code, _, err = _run(capsys, "replay", tmp_path / "loop")
    assert code == 2 and "symbolic links" in err and "not found" not in err, err


def test_info_config_needs_no_home(monkeypatch, capsys):
    """No HOME and no GEMMA_PARITY_CACHE: `info --config` reads a config file and needs no cache."""
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("GEMMA_PARITY_CACHE", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(no_home))
    code, out, err = _run(capsys, "info", "--config", ROOT / "fixtures" / "configs" / "gemma-4-12b-it.json")
    assert code == 0 and "HBM" in out, err


def test_a_closed_stdout_ends_quietly_with_141():
    """`info | head -1`: the reader closed the pipe; exit 141 (128 + SIGPIPE), nothing on stderr."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line (head -1 after its line, deterministically)
    info = subprocess.run([sys.executable, "-m", "harness", "info", "--config",
                           str(ROOT / "fixtures" / "configs" / "gemma-4-12b-it.json")],
                          stdout=write, stderr=subprocess.PIPE, env=os.environ, timeout=120)
    os.close(write)
    assert info.returncode == 141 and info.stderr == b"", info.stderr
