"""Hostile surroundings rather than hostile files: signals while the command is still importing,
and arguments and paths that are not UTF-8 (Python keeps their bytes as lone surrogates), in
messages, crash files and reports. Each keeps the exit-code contract, prints no traceback and
leaves the disk as it was (or, for a run that succeeds, writes what was asked)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib

import pytest

from tests.inputs.scenarios import REPO, cli_env, run_inprocess, run_subprocess, snapshot

NOT_UTF8 = os.fsdecode(b"\xff")  # how Python hands a non-UTF-8 argument byte to the program


# ---- signals from the first instruction -----------------------------------------------------------

def test_the_console_script_is_the_guarded_entry_point():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gemma-parity"] == "harness.entry:main"


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_while_importing_exits_with_one_line(tmp_path, sig, code, word):
    """Ctrl-C or SIGTERM while torch and transformers are still being imported (the first seconds
    of every run): one line and the contract's status, no traceback, no silent kill, nothing
    written. `-X importtime` reports each finished import, so the signal is sent just after the
    entry module (and its handlers) are in place and long before the commands are imported."""
    out = tmp_path / "info.json"
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c", "import sys; from harness.entry import main; "
                             "sys.exit(main())", "info", "--model", "tiny", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO)
    imported = []
    for line in proc.stderr:
        imported.append(line)
        if "| harness.entry" in line:
            break
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == code, err[-2000:]
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in err, lines
    assert "| torch\n" not in "".join(imported)  # the signal came before torch was imported
    assert list(tmp_path.iterdir()) == []


# ---- arguments and paths that are not UTF-8 -------------------------------------------------------

def test_a_missing_input_with_a_non_utf8_name_is_named_with_its_byte(tmp_path, capsys):
    missing = tmp_path / f"prompts{NOT_UTF8}.json"
    outcome = run_inprocess(["check", "--model", "tiny", "--prompts", missing], capsys)
    assert outcome.code == 2 and f"{tmp_path}/prompts\\xff.json: not found" in outcome.err, outcome.err
    assert "Traceback" not in outcome.err


def test_an_internal_error_with_a_non_utf8_argument_still_writes_its_crash_file(tmp_path, monkeypatch, capsys):
    """Today's failure: the crash file could not be written (two tracebacks, exit 1, an empty
    file). Now: exit 70, one message, and the crash file holds the argument (as \\xff) and the
    traceback."""
    import harness.port.sharding

    monkeypatch.setattr(harness.port.sharding, "plan_summary", lambda *a, **k: 1 / 0)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    out = tmp_path / f"info{NOT_UTF8}.json"
    outcome = run_inprocess(["info", "--model", "tiny", "--json", out], capsys)
    assert outcome.code == 70, outcome.err
    crash = [p for p in tmp_path.iterdir() if p.name.startswith("gemma-parity-crash-")]
    assert len(crash) == 1, sorted(p.name for p in tmp_path.iterdir())
    text = crash[0].read_text(encoding="utf-8")
    assert "info\\xff.json" in text and "ZeroDivisionError" in text and "Traceback" in text
    assert outcome.err.count("gemma-parity info:") == 2 and "Traceback" not in outcome.err  # message + where


@pytest.mark.slow  # about 11 CPU-seconds (a bisect process); the refusal with such bytes stays in the default lane
def test_reports_named_with_non_utf8_bytes_are_written_and_printed(tmp_path, tiny0_dir, small_golden_dir):
    """bisect (a real process, whose stdout is strict UTF-8) with --report and --json named with a
    non-UTF-8 byte: exit 0, its verdict and the report's name printed (the byte as \\xff), and the
    files written under the names asked for."""
    report, json_out = tmp_path / f"r{NOT_UTF8}", tmp_path / f"r{NOT_UTF8}.json"
    outcome = run_subprocess(["bisect", "--checkpoint", tiny0_dir, "--golden", small_golden_dir, "--report", report,
                              "--json", json_out])
    assert outcome.code == 0, outcome.err[-3000:]
    assert "BISECT PASS" in outcome.out and f"report written to {tmp_path}/r\\xff" in outcome.out
    assert "Traceback" not in outcome.err
    assert sorted(p.name for p in report.iterdir()) == [".gemma-parity-manifest.json", "bisect.json", "bisect.md",
                                                        "bisect_errors.png"]
    assert json_out.is_file()


@pytest.fixture(scope="module")
def small_golden_dir(tmp_path_factory, tiny0_ckpt):
    from tests.inputs.scenarios import small_golden

    return small_golden(tmp_path_factory.mktemp("env") / "golden", tiny0_ckpt)


def test_a_refusal_with_non_utf8_bytes_leaves_the_disk_unchanged(tmp_path, tiny0_dir, capsys):
    config = tmp_path / f"c{NOT_UTF8}"
    config.mkdir()
    before = snapshot(tmp_path)
    outcome = run_inprocess(["info", "--config", config], capsys)
    assert outcome.code == 2 and f"{tmp_path}/c\\xff: is a directory" in outcome.err, outcome.err
    assert snapshot(tmp_path) == before


def test_a_named_pipe_in_a_history_is_skipped_not_read(tmp_path):
    """A FIFO called *.json among the runs: `perf compare --history` used to block on it for ever.
    Now it is skipped with a note and the real runs are compared (in a subprocess, with a timeout,
    so a regression fails instead of hanging the suite)."""
    import json

    from tests.inputs.scenarios import perf_result

    history = tmp_path / "h"
    history.mkdir()
    for k in range(2):
        (history / f"run{k}.json").write_text(json.dumps({**perf_result(), "created": f"2026-01-0{k + 1}T00:00:00+00:00"}))
    os.mkfifo(history / "zz.json")
    outcome = run_subprocess(["perf", "compare", "--history", history], timeout=120)
    assert outcome.code == 0, outcome.err
    assert f"{history / 'zz.json'}: not a regular file, so not a run; skipped" in outcome.err
