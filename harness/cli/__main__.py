"""`python -m harness.cli` runs the gemma-parity command."""

import sys

from harness.cli import main

sys.exit(main())
