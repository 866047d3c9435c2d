"""The `gemma-parity` console script: Ctrl-C and SIGTERM are handled from its first instruction.

Importing the commands takes a second or two (torch, transformers). Until they are imported a
signal has nothing to unwind and nothing half written to remove, so it ends the process at once
with the contract's one line and status (130 interrupted, 143 terminated) instead of a traceback
from inside an import (Ctrl-C) or a silent kill (SIGTERM). Once the commands are imported, their
own handling (harness/cli/__init__.py) takes over. This module imports nothing heavy before its
handlers are in place: keep it that way.
"""

import sys

from harness.base.signal_guard import guard as _guard

_guard()  # at import: the console script imports this module before it calls main()


def main() -> int:
    _guard()  # again, for a caller that imported this module earlier and changed the handlers
    from harness.cli import main as cli_main

    return cli_main()  # it installs its own handlers once the arguments are parsed


if __name__ == "__main__":
    sys.exit(main())
