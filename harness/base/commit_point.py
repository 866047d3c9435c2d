"""The commit point of a command's final output, and Ctrl-C / SIGTERM after it (one home for the
decision; docs/inputs.md#interrupts).

Before a command's final output is put in place, a signal unwinds the run: the temp directory is
removed and a previous output (a golden replaced with `reference --overwrite`) stays whole. From the
moment the new output is about to replace it (harness/base/atomic.atomic_directory with
`final=True`) until the command returns, a signal is held instead: the swap is one rename, the
output is complete, so the run finishes, exits with its own status and says that the interrupt came
after the output was written (harness/cli/__init__.py). Only the command line arms this; a library
caller's signals are never touched.
"""

from __future__ import annotations

import signal

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state: dict = {"armed": False, "previous": None, "held": []}


def arm() -> None:
    """The command line: a final output's commit point may hold signals from now on."""
    _state.update(armed=True, previous=None, held=[])


def _hold(signum, frame) -> None:
    _state["held"].append(signum)


def committing() -> None:
    """Called just before a final output replaces its target: hold signals from here (armed only,
    main thread only, once)."""
    if not _state["armed"] or _state["previous"] is not None:
        return
    try:
        _state["previous"] = {s: signal.signal(s, _hold) for s in _SIGNALS}
    except ValueError:  # not the main thread: signals cannot be handled here at all
        _state["previous"] = None


def finish() -> list[int]:
    """The command returned (or failed): put the handlers back, disarm, and return the signals held
    since the commit point (empty when none came or nothing was committed)."""
    previous, held = _state["previous"], list(_state["held"])
    _state.update(armed=False, previous=None, held=[])
    for signum, handler in (previous or {}).items():
        signal.signal(signum, handler)
    return held


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
