"""`python -m harness.cli` runs the gemma-parity command."""

import sys

from harness.cli import main

try:
    sys.exit(main())
except KeyboardInterrupt:  # Ctrl-C while Python imports torch, before main() can catch it
    print("gemma-parity: interrupted", file=sys.stderr)
    sys.exit(130)
