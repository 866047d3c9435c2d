"""`gemma-parity reduce BUNDLE OUT`: shrink an HLO bundle's failing module while the oracle still fails
(harness/bundle/reduce.py; docs/snapshot.md#reducing-a-bundle)."""

from __future__ import annotations

from pathlib import Path

from harness.base.errors import OptionError
from harness.cli.common import EXIT_OK


def add_command(sub) -> None:
    p = sub.add_parser("reduce", help="shrink an HLO bundle's failing module while it still fails",
                       description="Keep one failing output of an HLO bundle (bisect --emit-repro / check --snapshot "
                                   "write them as hlo-rank{r}/), drop what it does not need and replace instructions "
                                   "by constants of their reference values while the oracle still fails; write the "
                                   "reduced bundle to OUT and print the instruction counts before and after. Exit 0 "
                                   "reduced, 2 bad bundle or input (a missing or altered file, a module that does "
                                   "not fail here).")
    p.add_argument("bundle", metavar="BUNDLE", help="an HLO bundle directory (holding bundle.json)")
    p.add_argument("out", metavar="OUT", help="where to write the reduced bundle (a new directory)")
    p.add_argument("--oracle", metavar="CMD", default=None,
                   help="a shell command run with a candidate bundle's directory as its last argument; exit 1 "
                        "means it still fails (default: the bundle's own compare on the platform at hand)")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    if not (Path(args.bundle) / "bundle.json").is_file():
        raise OptionError(f"{args.bundle}: no bundle.json: not an HLO bundle (bisect --emit-repro DIR writes "
                          "DIR/hlo-rank0/ ...)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OptionError(f"{args.out}: exists and is not an empty directory; name a new one")


def run(args) -> int:
    from harness.bundle.reduce import reduce_bundle

    reduce_bundle(args.bundle, args.out, oracle=args.oracle)
    return EXIT_OK
