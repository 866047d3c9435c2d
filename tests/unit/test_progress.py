"""Progress of long runs: silent where stderr is not a terminal (logs, pipes, CI), plain lines when
GEMMA_PARITY_PROGRESS asks for them, a status line on a terminal, nothing when disabled."""

from __future__ import annotations

import io

from harness.base.progress import status


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_steps(enabled: bool = True) -> None:
    with status("bisect", enabled, total=2) as say:
        say("layer 1/2")
        say("layer 2/2")


def test_quiet_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("GEMMA_PARITY_PROGRESS", raising=False)
    run_steps()
    assert capsys.readouterr().err == ""


def test_plain_lines_when_asked_for_without_a_terminal(monkeypatch, capsys):
    monkeypatch.setenv("GEMMA_PARITY_PROGRESS", "1")
    run_steps()
    assert capsys.readouterr().err.splitlines() == ["[bisect] layer 1/2", "[bisect] layer 2/2"]


def test_a_status_line_on_a_terminal_and_nothing_when_disabled(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("GEMMA_PARITY_PROGRESS", "1")  # a terminal gets the status line, not plain lines
    run_steps()
    shown = terminal.getvalue()
    assert "[bisect]" in shown and "layer 2/2" in shown and "\n[bisect] layer 1/2\n" not in shown
    quiet = FakeTerminal()
    monkeypatch.setattr("sys.stderr", quiet)
    run_steps(enabled=False)
    assert quiet.getvalue() == ""


def test_status_line_has_no_stray_separator(monkeypatch):
    """The terminal line reads "[port] prompt 0/4", not tqdm's postfix form "[port] , prompt 0/4"."""
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with status("port", total=2) as say:
        say("prompt 0/1")
    shown = terminal.getvalue()
    assert "[port] prompt 0/1" in shown and "[port] ," not in shown


def test_transformers_bars_are_silent_where_stderr_is_not_a_terminal(tmp_path, monkeypatch, capsys):
    """Loading a model through transformers (its "Loading weights" bar) and saving one (its
    "Writing model shards" bar) print nothing to a stderr that is not a terminal, even with
    GEMMA_PARITY_PROGRESS=1 (which asks for the harness's own plain lines, not third-party bars)."""
    from transformers.utils import logging as transformers_logging

    from harness.inputs.tiny import build_tiny_checkpoint
    from harness.reference.run import load_reference_model

    monkeypatch.setenv("GEMMA_PARITY_PROGRESS", "1")
    transformers_logging.enable_progress_bar()  # as a fresh process starts
    try:
        out = build_tiny_checkpoint(tmp_path / "tiny")
        load_reference_model(out)
        err = capsys.readouterr().err
        assert "Writing model shards" not in err and "Loading weights" not in err, err
    finally:
        transformers_logging.enable_progress_bar()


def test_transformers_bars_are_left_alone_on_a_terminal(monkeypatch):
    from transformers.utils import logging as transformers_logging

    from harness.base.progress import third_party_bars

    monkeypatch.setattr("sys.stderr", FakeTerminal())
    transformers_logging.enable_progress_bar()
    third_party_bars()
    assert transformers_logging.is_progress_bar_enabled()
