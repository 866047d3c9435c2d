"""`python -m harness.cli` runs the gemma-parity command. Python imports this package first, and its
__init__ installs the signal guard (harness/base/signal_guard.py) before the commands (torch,
transformers) are imported: Ctrl-C at any point after that exits 130 with one line, never a traceback."""

import sys

from harness.base.signal_guard import guard

guard()  # again, in case a caller changed the handlers after importing the package

from harness.cli import main  # noqa: E402  (after the guard)

sys.exit(main())
