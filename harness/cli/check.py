"""`gemma-parity check`: run the port and compare every layer and token with the reference."""

from __future__ import annotations

from harness.atomic import write_json_atomic
from harness.cli.common import EXIT_FAIL, EXIT_OK, add_model_args, add_port_args, checkpoint_dir


def add_command(sub) -> None:
    p = sub.add_parser("check", help="run the port and compare every layer and token with the reference")
    add_model_args(p)
    p.add_argument("--golden", metavar="DIR", help="reuse a golden instead of recomputing the reference")
    p.add_argument("--prompts", metavar="FILE", help="JSON list of token-id lists (default: fixtures/prompts/default.json)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens to decode (default 8)")
    p.add_argument("--skip-fp32-stage", action="store_true",
                   help="skip the fp32 structural stage (it holds the model in fp32 on the host)")
    add_port_args(p, "write a Markdown summary, the JSON and a PNG plot")
    p.set_defaults(func=run)


def run(args) -> int:
    from harness.checkpoint import Checkpoint
    from harness.parity import run_parity_check
    from harness.reference import torch_dtype
    from harness.report import format_check, write_report

    ckpt_dir = checkpoint_dir(args)
    ckpt = Checkpoint.open(ckpt_dir)
    print(ckpt.describe())
    result = run_parity_check(ckpt, ckpt_dir, golden=args.golden, prompts=args.prompts, backend=args.backend,
                              tp=args.tp, dtype=torch_dtype(args.dtype), new_tokens=args.new_tokens,
                              buckets=args.buckets, kv_len=args.kv_len, progress=True,
                              fp32_stage=not args.skip_fp32_stage)
    print(format_check(result))
    payload = result.to_json()
    if args.json:
        write_json_atomic(args.json, payload)
    if args.report:
        write_report(args.report, "check", payload, ckpt.spec)
    return EXIT_OK if result.passed else EXIT_FAIL
