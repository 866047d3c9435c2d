"""`gemma-parity info`: the resolved per-layer spec, the TP plan and device bytes per rank."""

from __future__ import annotations

from harness.atomic import write_json_atomic
from harness.cli.common import EXIT_OK, add_model_args, checkpoint_dir


def add_command(sub) -> None:
    p = sub.add_parser("info", help="resolved per-layer spec, TP sharding plan and bytes per rank")
    add_model_args(p, config=True)
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="device dtype for the memory estimate")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length for the memory estimate")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--perf", action="store_true", help="also print each device graph's roofline floors on "
                   "inf2.8xlarge (prefill at bucket 64, decode), computed without running anything")
    p.set_defaults(func=run)


def run(args) -> int:
    from harness.report import format_info
    from harness.sharding import plan_summary
    from harness.spec import load_spec

    if args.config:
        spec = load_spec(args.config)
    else:
        from harness.checkpoint import Checkpoint

        ckpt = Checkpoint.open(checkpoint_dir(args))
        spec = ckpt.spec
        print(ckpt.describe())
    payload = plan_summary(spec, args.tp, args.dtype, args.kv_len)
    print(format_info(payload))
    if args.perf:
        from harness.perf import info_floors, render_roofline

        payload["roofline"] = info_floors(spec, args.tp, args.dtype, args.kv_len)
        print(render_roofline(payload["roofline"]), end="")
    if args.json:
        write_json_atomic(args.json, payload)
    return EXIT_OK
