"""`python -m harness` runs the gemma-parity command with its signal guard (harness/entry.py)."""

import sys

from harness.entry import main

sys.exit(main())
