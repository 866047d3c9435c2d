"""`gemma-parity reference`: run the CPU fp32 and bf16 references and write a golden."""

from __future__ import annotations

from harness.cli.common import EXIT_OK, add_model_args, checkpoint_dir


def add_command(sub) -> None:
    p = sub.add_parser("reference", help="run the CPU fp32 and bf16 reference and write a golden")
    add_model_args(p)
    p.add_argument("--prompts", metavar="FILE", help="JSON list of token-id lists (or strings with a tokenizer)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens to decode (default 8)")
    p.add_argument("--stream", action="store_true",
                   help="prefill captures one layer at a time (peak memory ~ embeddings + one layer); no decode")
    p.add_argument("--out", required=True, metavar="DIR", help="golden directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing golden deliberately")
    p.set_defaults(func=run)


def run(args) -> int:
    from harness.golden import make_golden

    written = make_golden(checkpoint_dir(args), args.out, args.prompts, args.new_tokens, stream=args.stream,
                          overwrite=args.overwrite, progress=True)
    print(f"golden written to {written.path}: {len(written.prompts)} prompt(s), {written.new_tokens} new "
          f"token(s); fp32 tokens {written.tokens}")
    return EXIT_OK
