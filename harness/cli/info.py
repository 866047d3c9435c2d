"""`gemma-parity info`: the resolved per-layer spec, the TP plan and device bytes per rank."""

from __future__ import annotations

from harness.atomic import write_json_atomic
from harness.cli import validate as v
from harness.cli.common import EXIT_OK, add_model_args, add_run_args, run_settings, with_generator


def add_command(sub) -> None:
    p = sub.add_parser("info", help="resolved per-layer spec, TP sharding plan and bytes per rank",
                       description="The resolved per-layer spec, the TP plan and device bytes per rank. "
                                   "Exit 0, or 2 on bad input.")
    add_model_args(p, config=True)
    add_run_args(p, fields=("tp", "dtype", "kv_len"), purpose="device dtype of the memory estimate")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--perf", action="store_true", help="also print each device graph's roofline floors on "
                   "inf2.8xlarge (prefill at bucket 64, decode), computed without running anything")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness.spec import load_spec

    v._int_option(args, "tp", 1)
    v._int_option(args, "kv_len", 1)
    v._int_option(args, "seed", 0)
    args.settings = run_settings(args)
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


def _is_published_model(spec) -> bool:
    """Whether the spec is the model the published latency was measured on (the 12B, whose config
    the repository ships): only then is "floor / published" a comparison of like with like."""
    from harness import FIXTURES_DIR
    from harness.spec import load_spec

    return spec.spec_hash() == load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json").spec_hash()


def run(args) -> int:
    from harness.report import format_info
    from harness.sharding import plan_summary

    if args.ckpt is not None:
        print(args.ckpt.describe())  # it says what is inert; the plan below does not repeat it
    s = args.settings
    payload = plan_summary(args.spec, s.tp, s.dtype, s.kv_len)
    from harness.instances import plan_notes

    payload["placement"] = args.placement
    payload["notes"] = plan_notes(args.spec, args.placement)
    print(format_info({**payload, "inert": None} if args.ckpt is not None else payload))
    if args.perf:
        from harness.perf import info_floors, render_roofline

        payload["roofline"] = info_floors(args.spec, s.tp, s.dtype, s.kv_len)
        if not _is_published_model(args.spec):
            payload["roofline"].pop("published_ms", None)  # the published latency is the 12B's, not this model's
        print(render_roofline(payload["roofline"]), end="")
    if args.json is not None:
        write_json_atomic(args.json, with_generator(payload, "info"))
    return EXIT_OK
