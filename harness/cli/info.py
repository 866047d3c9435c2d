"""`gemma-parity info`: the resolved per-layer spec, the TP plan and device bytes per rank."""

from __future__ import annotations

from harness.atomic import write_json_atomic
from harness.cli import validate as v
from harness.cli.common import EXIT_OK, add_model_args, with_generator


def add_command(sub) -> None:
    p = sub.add_parser("info", help="resolved per-layer spec, TP sharding plan and bytes per rank",
                       description="The resolved per-layer spec, the TP plan and device bytes per rank. "
                                   "Exit 0, or 2 on bad input.")
    add_model_args(p, config=True)
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="device dtype for the memory estimate")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length for the memory estimate")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--perf", action="store_true", help="also print each device graph's roofline floors on "
                   "inf2.8xlarge (prefill at bucket 64, decode), computed without running anything")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness.spec import DTYPE_BYTES, load_spec

    v._int_option(args, "tp", 1)
    v._int_option(args, "kv_len", 1)
    v._int_option(args, "seed", 0)
    v._dtype(args, DTYPE_BYTES)
    inputs = v.model_inputs(args)
    outputs: dict = {}
    if args.json is not None:
        v.replaceable_file(v.output_location(args.json, "--json", False, inputs, outputs), "--json", v._json_is_ours)
    v.clean_leftovers(outputs.values())
    if args.config is not None:
        args.spec, args.ckpt = load_spec(args.config), None
    else:
        args.spec = v.open_checkpoint(args).spec
    v.check_tp(args.spec, args.tp)
    v.check_kv_len(args.spec, args.kv_len)
    from harness.instances import check_fits

    args.placement = check_fits(args.spec, args.tp, args.dtype, args.kv_len)


def run(args) -> int:
    from harness.report import format_info
    from harness.sharding import plan_summary

    if args.ckpt is not None:
        print(args.ckpt.describe())
    from harness.instances import plan_notes

    payload = plan_summary(args.spec, args.tp, args.dtype, args.kv_len)
    payload["placement"] = args.placement
    payload["notes"] = plan_notes(args.spec, args.placement)
    print(format_info(payload))
    if args.perf:
        from harness.perf import info_floors, render_roofline

        payload["roofline"] = info_floors(args.spec, args.tp, args.dtype, args.kv_len)
        print(render_roofline(payload["roofline"]), end="")
    if args.json is not None:
        write_json_atomic(args.json, with_generator(payload, "info"))
    return EXIT_OK
