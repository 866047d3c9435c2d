"""The command's signal guard before its commands are imported (what harness/entry.py describes),
in a module of its own that imports nothing heavy and nothing of the project: the console script
(harness/entry.py) and `python -m harness.cli` (harness/cli/__init__.py) both install it first."""

import os
import signal

_STATUS = {signal.SIGINT: (130, "interrupted"), signal.SIGTERM: (143, "terminated")}


def _exit_now(signum, frame):
    code, what = _STATUS[signum]
    try:
        os.write(2, f"gemma-parity: {what} while starting; nothing was written\n".encode())
    except OSError:  # stderr closed: the status still says it
        pass
    finally:
        os._exit(code)


def guard() -> None:
    for signum in _STATUS:
        signal.signal(signum, _exit_now)
