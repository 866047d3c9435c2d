"""`gemma-parity graphs`: per-graph statistics and contracts of a config's device graphs (XLA lane)."""

from __future__ import annotations

from harness.base.atomic import write_json_atomic
from harness.base.settings import PUBLISHED_BUCKET, RunSettings
from harness.cli import validate as v
from harness.cli.common import EXIT_FAIL, EXIT_OK, add_run_args, run_settings, with_generator
from harness.cli.output_paths import _json_is_ours, clean_leftovers, output_location, replaceable_file

# What graphs lowers unless told: the published port's prefill bucket.
GRAPHS_SETTINGS = RunSettings(backend="xla", buckets=(PUBLISHED_BUCKET,))


def add_command(sub) -> None:
    p = sub.add_parser("graphs", help="per-graph statistics (FLOPs, weight bytes, bytes returned) and graph "
                                      "contracts of a config's device graphs, lowered by torch-xla (XLA lane)",
                       description="Lower one layer of each type at the config's real widths plus the "
                                   "embedding/head ends with torch-xla, check the graph contracts, and scale "
                                   "the statistics by the layer counts. Exit 0, 1 when a contract breaks, "
                                   "2 on bad input or without torch-xla.")
    p.add_argument("--config", required=True, metavar="FILE", help="a config.json (no weights needed)")
    add_run_args(p, GRAPHS_SETTINGS, ("tp", "dtype", "buckets", "kv_len"), purpose="graph dtype")
    p.add_argument("--json", metavar="FILE", help="also write the statistics as JSON")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness.inputs.spec import load_spec

    v._int_option(args, "tp", 1)
    v._int_option(args, "kv_len", 1)
    args.settings = run_settings(args)
    inputs = {"--config": v.input_path(args.config, "--config", want_dir=False)}
    outputs: dict = {}
    if args.json is not None:
        replaceable_file(output_location(args.json, "--json", False, inputs, outputs), "--json", _json_is_ours)
    clean_leftovers(outputs.values())
    args.spec = load_spec(args.config)
    v.check_tp(args.spec, args.tp)
    v.check_kv_len(args.spec, args.kv_len)
    if max(args.buckets) > args.kv_len:
        from harness.base.errors import OptionError

        raise OptionError(f"--buckets {max(args.buckets)}: larger than --kv-len {args.kv_len}; buckets must fit "
                          "in the cache")


def run(args) -> int:
    from harness.hlo.stats import model_graph_stats
    from harness.report.formats import format_graph_stats

    result = model_graph_stats(args.spec, args.settings, progress=True)
    print(format_graph_stats(result))
    for tag, g in result["graphs"].items():
        for piece, violations in g["contract_violations"].items():
            print(f"{tag} {piece}: " + "; ".join(violations[:4]))
    if args.json is not None:
        write_json_atomic(args.json, with_generator(result, "graphs"))
    return EXIT_OK if not any(g["contract_violations"] for g in result["graphs"].values()) else EXIT_FAIL
