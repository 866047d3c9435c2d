"""Progress of long runs: silent where stderr is not a terminal (logs, pipes, CI), plain lines when
GEMMA_PARITY_PROGRESS asks for them, a status line on a terminal, nothing when disabled."""

from __future__ import annotations

import io

from harness.progress import status


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
