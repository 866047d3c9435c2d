"""`python -m harness.cli` runs the gemma-parity command with its signal guard (harness/entry.py)
in place before the commands (torch, transformers) are imported: Ctrl-C at any point after the
interpreter reaches this module exits 130 with one line, never a traceback."""

import sys

from harness.entry import main  # first: installs the guard; imports nothing heavy

sys.exit(main())
