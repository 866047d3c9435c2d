"""`--snapshot DIR` and `--emit-repro DIR` of check and bisect (docs/snapshot.md): registered,
validated before model work, and run once after the command's own run, each by one call."""

from __future__ import annotations

from pathlib import Path

from harness.base.atomic import claim_output
from harness.base.errors import OptionError

HINT = ("to replay this failure off-chip, rerun with --snapshot DIR (the failing device call, replayable with "
        "`gemma-parity replay DIR`){repro}")


def add_snapshot_args(p, repro: bool = False) -> None:
    p.add_argument("--snapshot", metavar="DIR", help="write the device call behind the first failing point (on a "
                   "passing run, the one with the largest ratio, as a control) to DIR, a new directory, for "
                   "`gemma-parity replay` (docs/snapshot.md)")
    p.add_argument("--demo-fault", metavar="NAME", default=None,
                   help="plant a known port bug (rope-pairs) to watch the snapshot, replay and repro fail on CPU; "
                        "every output says so (docs/snapshot.md#a-failure-to-look-at). Never for a real run")
    if repro:
        p.add_argument("--emit-repro", metavar="DIR", help="write a standalone repro.py (torch and safetensors "
                       "only) and its tensors of the first failing layer to DIR, a new directory")


def validate_snapshot_args(args) -> None:
    """The output directories are new, distinct, and the run is one that has a call to snapshot;
    --demo-fault planted for the rest of the command, announced."""
    from harness.snapshot.write import refuse_existing

    if getattr(args, "demo_fault", None) is not None:
        from harness.port.demo_fault import banner, check_name, plant

        check_name(args.demo_fault)
        if args.settings.backend != "cpu":
            raise OptionError(f"--demo-fault {args.demo_fault}: the demonstration runs on the cpu backend; drop "
                              f"--backend {args.settings.backend}")
        args.settings = args.settings.but(demo_fault=args.demo_fault)
        plant(args.demo_fault)  # this process is the command: the bug stays planted until it exits
        print(banner(args.demo_fault), flush=True)

    given = [(flag, getattr(args, attr, None)) for flag, attr in (("--snapshot", "snapshot"),
                                                                  ("--emit-repro", "emit_repro"))]
    given = [(flag, path) for flag, path in given if path is not None]
    if len(given) == 2 and Path(given[0][1]).resolve() == Path(given[1][1]).resolve():
        raise OptionError("--snapshot and --emit-repro name the same directory; give each its own")
    for flag, path in given:
        refuse_existing(path, flag)
        claim_output(Path(path), flag)  # a second run for the same directory is refused now
    if not given:
        return
    flags = " and ".join(flag for flag, _ in given)
    if args.settings.batch > 1:
        raise OptionError(f"{flags}: a snapshot holds one sequence's call; drop --batch {args.settings.batch}")
    mode = getattr(args, "mode", "capture")  # bisect's default off cpu is truncate (harness.parity.bisect)
    if mode == "truncate" or (mode is None and args.settings.backend != "cpu"):
        raise OptionError(f"{flags}: truncate mode keeps no per-point observation to snapshot; add --mode capture")


def after_run(args, check_result, command: str) -> None:
    """After the command's run: write what was asked for, or, on a failure, say how to ask; a demo
    run's banner last (its first line was one too)."""
    _after_run(args, check_result, command)
    if getattr(args, "demo_fault", None) is not None:
        from harness.port.demo_fault import banner

        print(banner(args.demo_fault), flush=True)


def _after_run(args, check_result, command: str) -> None:
    snapshot, repro = getattr(args, "snapshot", None), getattr(args, "emit_repro", None)
    if snapshot is None and repro is None:
        if check_result is not None and not check_result.passed:
            print(HINT.format(repro=" or --emit-repro DIR (a standalone script)" if command == "bisect" else ""))
        return
    if check_result is None:
        raise OptionError(f"--snapshot/--emit-repro: this {command} run kept no observation to snapshot")
    from harness.snapshot.write import snapshot_check

    if snapshot is not None:
        snapshot_check(check_result, args.ckpt, args.settings, snapshot, source=command)
        from harness.snapshot.repro import snapshot_bundles

        snapshot_bundles(check_result, args.ckpt, args.settings, snapshot)  # hlo-rank{r}/ beside it
    if repro is not None:
        from harness.snapshot.repro import emit_repro

        emit_repro(check_result, args.ckpt, args.settings, repro)
