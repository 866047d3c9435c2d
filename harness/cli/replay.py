"""`gemma-parity replay DIR`: a snapshot's device call run again on one or more backends and judged
by the check's own judge against the stored reference outputs (docs/snapshot.md)."""

from __future__ import annotations

from harness.base.errors import OptionError
from harness.cli.common import EXIT_FAIL, EXIT_OK


def add_command(sub) -> None:
    p = sub.add_parser("replay", help="replay a snapshot's device call on cpu, xla or neuron and judge it",
                       description="Run the device call a `--snapshot DIR` wrote again, whole or its failing layer "
                                   "alone on its recorded input, and judge it against the stored reference outputs "
                                   "by the check's judge. Several backends (--backend cpu,xla,neuron) name whose "
                                   "failure it is. Exit 0 every backend agrees, 1 one reproduces the failure, 2 bad "
                                   "snapshot or input (refused before any model work).")
    p.add_argument("snapshot", metavar="DIR", help="a directory written by check/bisect --snapshot")
    p.add_argument("--backend", default="cpu", metavar="NAMES",
                   help="comma-separated backends to replay on: cpu, xla, neuron (default cpu)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel degree (default: the snapshot's)")
    p.add_argument("--layer", type=int, default=None, metavar="N",
                   help="run only layer N (the snapshot's failing layer) alone on its recorded input (cpu)")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="the checkpoint the snapshot came from (default: the path it records); its hashes must match")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    """The snapshot by itself, then against the checkpoint, then what each backend's replay needs."""
    from harness.backends import BACKENDS
    from harness.inputs.checkpoint import Checkpoint
    from harness.port.sharding import plan_model
    from harness.snapshot.read import SnapshotError, check_checkpoint, read_snapshot
    from harness.snapshot.replay import check_mode

    names = [b.strip() for b in args.backend.split(",") if b.strip()]
    unknown = [b for b in names if b not in BACKENDS]
    if not names or unknown or len(set(names)) != len(names):
        raise OptionError(f"--backend {args.backend!r}: give distinct backends among {', '.join(BACKENDS)}")
    if args.tp is not None and args.tp < 1:
        raise OptionError(f"--tp {args.tp}: need a positive tensor parallel degree")
    snap = args.snap = read_snapshot(args.snapshot)
    if args.layer is not None and snap.target.get("host"):
        raise OptionError(f"--layer {args.layer}: this snapshot is of a host step ({snap.target['host']}), no layer is "
                          "behind it; drop --layer")
    if args.layer is not None and args.layer != snap.layer:
        raise OptionError(f"--layer {args.layer}: this snapshot holds layer {snap.layer}'s input and outputs only; "
                          f"pass --layer {snap.layer} or drop it")
    path = args.checkpoint or snap.manifest["checkpoint"]["path"]
    try:
        ckpt = args.ckpt = Checkpoint.open(path)
    except OptionError:
        raise
    except Exception as exc:
        if args.checkpoint is None:
            raise SnapshotError(f"{snap.path}: the checkpoint it records ({path}) cannot be opened ({exc}); pass the "
                                "checkpoint it came from with --checkpoint DIR") from None
        raise
    quantize = snap.run_settings().quantize
    if quantize:  # the structural truth of an int8 port: the quantized model, rebuilt from this checkpoint
        from harness.inputs.quantized_checkpoint import quantized_reference

        ckpt = args.ckpt = quantized_reference(ckpt, quantize)
    check_checkpoint(snap, ckpt)
    args.tp = args.tp or snap.tp
    plan_model(ckpt.spec, args.tp)  # a TP degree the model cannot shard is refused here
    args.mode = "layer" if args.layer is not None else "whole"
    args.backends = names
    for name in names:
        check_mode(snap, name, args.mode, args.tp)


def run(args) -> int:
    from harness.snapshot.read import describe
    from harness.snapshot.replay import replay, whose

    demo = args.snap.run_settings().demo_fault
    if demo:  # a demo snapshot: its planted bug is planted again for the replay (harness/port/demo_fault.py)
        from harness.port.demo_fault import banner

        print(banner(demo) + " (recorded in this snapshot; planted again for the replay)")
    print(describe(args.snap))
    replays = []
    for name in args.backends:
        replays.append(replay(args.snap, args.ckpt, name, tp=args.tp, mode=args.mode))
        print(replays[-1].describe())
    print(whose(args.snap, replays))
    if demo:
        print(banner(demo))
    return EXIT_FAIL if any(r.reproduces for r in replays) else EXIT_OK
