"""`gemma-parity graphs`: per-graph statistics and contracts of a config's device graphs (XLA lane)."""

from __future__ import annotations

from harness.atomic import write_json_atomic
from harness.cli import validate as v
from harness.cli.common import EXIT_FAIL, EXIT_OK, buckets_arg, with_generator


def add_command(sub) -> None:
    p = sub.add_parser("graphs", help="per-graph statistics (FLOPs, weight bytes, bytes returned) and graph "
                                      "contracts of a config's device graphs, lowered by torch-xla (XLA lane)",
                       description="Lower one layer of each type at the config's real widths plus the "
                                   "embedding/head ends with torch-xla, check the graph contracts, and scale "
                                   "the statistics by the layer counts. Exit 0, 1 when a contract breaks, "
                                   "2 on bad input or without torch-xla.")
    p.add_argument("--config", required=True, metavar="FILE", help="a config.json (no weights needed)")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length (default 256)")
    p.add_argument("--buckets", type=buckets_arg, default=(64,), help="prefill buckets (default 64)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", metavar="FILE", help="also write the statistics as JSON")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness.spec import load_spec

    v._int_option(args, "tp", 1)
    v._int_option(args, "kv_len", 1)
    inputs = {"--config": v.input_path(args.config, "--config", want_dir=False)}
    outputs: dict = {}
    if args.json is not None:
        v.replaceable_file(v.output_location(args.json, "--json", False, inputs, outputs), "--json", v._json_is_ours)
    v.clean_leftovers(outputs.values())
    args.spec = load_spec(args.config)
    v.check_tp(args.spec, args.tp)
    v.check_kv_len(args.spec, args.kv_len)
    if max(args.buckets) > args.kv_len:
        from harness.errors import OptionError

        raise OptionError(f"--buckets {max(args.buckets)}: larger than --kv-len {args.kv_len}; buckets must fit "
                          "in the cache")


def run(args) -> int:
    import torch

    from harness.graph_stats import model_graph_stats
    from harness.report import format_graph_stats

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    result = model_graph_stats(args.spec, tp=args.tp, max_len=args.kv_len, buckets=args.buckets, dtype=dtype,
                               progress=True)
    print(format_graph_stats(result))
    for tag, g in result["graphs"].items():
        for piece, violations in g["contract_violations"].items():
            print(f"{tag} {piece}: " + "; ".join(violations[:4]))
    if args.json is not None:
        write_json_atomic(args.json, with_generator(result, "graphs"))
    return EXIT_OK if not any(g["contract_violations"] for g in result["graphs"].values()) else EXIT_FAIL
