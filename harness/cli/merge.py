"""`gemma-parity merge`: gather the quality golden's shards written on several machines into one
golden directory (harness/quality/merge.py), then judge it with `gemma-parity quality --golden`."""

from __future__ import annotations

from pathlib import Path

from harness.base.errors import OptionError
from harness.cli import validate as v
from harness.cli.common import EXIT_OK
from harness.cli.output_paths import output_location


def add_command(sub) -> None:
    p = sub.add_parser(
        "merge", help="gather quality golden shards from several machines into one golden directory",
        description="Gather the shards that `quality --shard I/N` (or `--shard auto` under AWS Batch, Kubernetes "
                    "or Slurm) wrote on several machines, each into its own --golden directory, into one new golden "
                    "directory. Refuses missing, duplicated or mismatched shards and any damaged part, before "
                    "writing anything. Exit 0 merged, 2 refused.")
    p.add_argument("sources", nargs="+", metavar="GOLDEN_DIR", help="the shard runs' --golden directories")
    p.add_argument("--out", required=True, metavar="DIR", help="the merged golden: a new or empty directory")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness.quality.merge import check_destination, plan_merge

    inputs = {f"source {k}": v.input_path(s, "GOLDEN_DIR", want_dir=True) for k, s in enumerate(args.sources)}
    if len({p.resolve() for p in inputs.values()}) < len(inputs):
        raise OptionError("GOLDEN_DIR: the same directory is given twice; give each shard run's directory once")
    out = output_location(args.out, "--out", True, inputs, {})
    check_destination(out)
    args.plan = plan_merge([Path(s) for s in args.sources])


def run(args) -> int:
    from harness.quality.merge import write_merge

    settings, _, owner = args.plan
    write_merge(Path(args.out), settings, owner)
    print(f"merged {settings.shards} shard(s) from {len(set(owner.values()))} director(ies) into {args.out}; "
          f"judge with `gemma-parity quality --golden {args.out} --corpus ... --checkpoint ...`")
    return EXIT_OK
