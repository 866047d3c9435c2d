"""The `gemma-parity` command: info, reference, check, bisect, bench and perf compare.

The top layer (DESIGN §4): argument parsing, printing and exit codes. Each command module adds its
subparser and calls one library function; nothing in `harness` below this package imports it.
"""

from __future__ import annotations

import argparse
import sys

from harness.cli import bisect, check, info, perf, reference
from harness.cli.common import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK  # noqa: F401  (the exit-code contract)
from harness.errors import HarnessInputError

COMMANDS = (info, reference, check, bisect, perf)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gemma-parity",
        description="Gemma-4 12B on Inferentia2 (TP=2): run the port, prove parity with the CPU fp32 "
                    "reference layer by layer, bisect divergences, and watch performance.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_command(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except HarnessInputError as exc:
        print(f"gemma-parity {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
