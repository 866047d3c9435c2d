"""An exception inside the port is a parity failure, not bad input: `port_call` runs one phase of
the port and turns what it raises into a `PortFailure` naming the phase and where it was raised
(the innermost frame, and the port's own frame that called it)."""

from __future__ import annotations

import traceback
from pathlib import Path


class PortFailure(Exception):
    """An exception raised inside the port while it was observed: a parity failure, not bad input."""

    def __init__(self, phase: str, exc: BaseException):
        super().__init__(f"{phase}: {type(exc).__name__}: {exc}")
        self.phase, self.exc = phase, exc

    def describe(self) -> dict:
        """Where it was raised (the innermost frame) and, when that is outside the package, the
        innermost frame of the port that called it."""
        frames = traceback.extract_tb(self.exc.__traceback__)
        package = Path(__file__).parent.parent
        inside = [f for f in frames if f.filename.startswith(str(package))]
        where = _frame(frames[-1], package.parent) if frames else "unknown"
        if inside and inside[-1] is not frames[-1]:
            where += f" (called from {_frame(inside[-1], package.parent)})"
        return {"where": where, "phase": self.phase, "type": type(self.exc).__name__, "message": str(self.exc)}


def _frame(frame, root: Path) -> str:
    path = Path(frame.filename)
    shown = path.relative_to(root) if path.is_relative_to(root) else path
    return f"{shown}:{frame.lineno} in {frame.name}"


def port_call(phase: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # anything the port raises is the port's failure
        raise PortFailure(phase, exc) from exc
