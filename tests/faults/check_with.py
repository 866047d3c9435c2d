"""`gemma-parity check` with one catalog fault injected into the port, as a user would inject it by
hand: `python -m tests.faults.check_with FAULT [check arguments]`. Exits as `check` does (0 pass,
1 fail, 2 bad input)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    import pytest

    from harness.cli import main as cli
    from tests.faults.catalog import BY_NAME

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BY_NAME:
        print(f"usage: python -m tests.faults.check_with FAULT [check args]; FAULT is one of {sorted(BY_NAME)}",
              file=sys.stderr)
        return 2
    with pytest.MonkeyPatch.context() as mp:
        BY_NAME[argv[0]].inject(mp)
        return cli(["check", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
