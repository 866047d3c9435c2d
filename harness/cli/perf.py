"""`gemma-parity bench` and `gemma-parity perf compare`: time the port, flag regressions."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.cli.common import buckets_arg
from harness.errors import HarnessInputError
from harness.perf import (DEFAULT_ALPHA, DEFAULT_FACTOR, DEFAULT_NEW_TOKENS, DEFAULT_RUNS, DEFAULT_WARMUP,
                          PUBLISHED_BUCKET, append_history, compare_files, compare_history, draw_trend, parse_budgets,
                          render_bench_summary, render_markdown, render_text, run_bench, write_json, write_text)


def add_command(subparsers) -> None:
    """Add `bench` and `perf compare`; each sets `func(args) -> exit code`."""
    from harness.backends import BACKENDS

    bench = subparsers.add_parser(
        "bench", help="time prefill and decode; write a result file (and add it to a history)",
        description="Time prefill per bucket and decode per token. Exit 0 ok, 2 bad input.")
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (safetensors)")
    source.add_argument("--model", choices=("tiny",), help="the cached tiny fixture model")
    bench.add_argument("--backend", choices=BACKENDS, default="cpu")
    bench.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="timed runs (default %(default)s)")
    bench.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="discarded runs first")
    bench.add_argument("--buckets", type=buckets_arg, default=(PUBLISHED_BUCKET,), metavar="16,64")
    bench.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, help="decode steps per run")
    bench.add_argument("--tp", type=int, default=2)
    bench.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    bench.add_argument("--kv-len", type=int, default=None, help="KV cache length (default: the engine's)")
    bench.add_argument("--out", required=True, metavar="FILE", help="result JSON (never overwritten "
                       "without --force)")
    bench.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    bench.add_argument("--history", metavar="DIR", help="also add the run to this history directory")
    bench.set_defaults(func=run_bench_command)

    perf = subparsers.add_parser("perf", help="compare benchmark results")
    perf_commands = perf.add_subparsers(dest="perf_command", metavar="{compare}", required=True)
    compare = perf_commands.add_parser(
        "compare", help="flag regressions and broken budgets",
        description="Compare a current run with a baseline. Exit 0 ok, 1 regression or broken "
                    "budget, 2 bad input.")
    compare.add_argument("--baseline", metavar="FILE")
    compare.add_argument("--current", metavar="FILE")
    compare.add_argument("--history", metavar="DIR", help="newest run in DIR vs the history's baseline, "
                         "and the change points over the history")
    compare.add_argument("--budget", action="append", default=[], metavar="METRIC=MS",
                         help="ceiling on a median, e.g. ttft_ms=101 (repeatable)")
    compare.add_argument("--factor", type=float, default=DEFAULT_FACTOR)
    compare.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    compare.add_argument("--allow-mismatch", action="store_true",
                         help="compare runs from different machines, specs or settings")
    compare.add_argument("--markdown", metavar="FILE", help="also write a Markdown report")
    compare.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    compare.add_argument("--plot", metavar="PNG", help="with --history: the trend plot (default: "
                         "<markdown stem>-trend.png beside --markdown; needs the plot extra)")
    compare.set_defaults(func=run_compare_command)


def _open_checkpoint(args):
    from harness.checkpoint import Checkpoint, tiny_checkpoint

    return Checkpoint.open(tiny_checkpoint(seed=0) if args.model == "tiny" else args.checkpoint)


def run_bench_command(args) -> int:
    try:
        out = Path(args.out)
        if out.exists() and not args.force:  # refuse before spending minutes benchmarking
            raise HarnessInputError(f"{out}: already exists; pass --force to overwrite it or choose "
                                    "another --out")
        result = run_bench(_open_checkpoint(args), backend=args.backend, runs=args.runs,
                           warmup=args.warmup, buckets=args.buckets, new_tokens=args.new_tokens,
                           tp=args.tp, dtype=args.dtype, kv_len=args.kv_len, progress=True)
        write_json(out, result, overwrite=args.force)
        print(render_bench_summary(result), end="")
        print(f"wrote {out}", file=sys.stderr)
        if args.history:
            print(f"added {append_history(result, args.history)}", file=sys.stderr)
        return 0
    except HarnessInputError as exc:
        print(f"gemma-parity bench: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an unwritable --out or --history location
        print(f"gemma-parity bench: error: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2


def run_compare_command(args) -> int:
    try:
        options = dict(factor=args.factor, alpha=args.alpha, budgets=parse_budgets(args.budget),
                       allow_mismatch=args.allow_mismatch)
        if args.history and not (args.baseline or args.current):
            comp = compare_history(args.history, **options)
        elif args.baseline and args.current and not args.history:
            comp = compare_files(args.baseline, args.current, **options)
        else:
            raise HarnessInputError("give --baseline FILE and --current FILE, or --history DIR alone")
        plot = _trend_plot(args, comp, options["budgets"])
        print(render_text(comp), end="")
        if args.markdown:
            link = None if plot is None else _relative(plot, Path(args.markdown).parent)
            write_text(args.markdown, render_markdown(comp, link), overwrite=True)  # a report, rewritten each run
        if args.json:
            write_json(args.json, comp.to_dict(), overwrite=True)
        return 1 if comp.failed else 0
    except HarnessInputError as exc:
        print(f"gemma-parity perf compare: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an unwritable --markdown or --json location
        print(f"gemma-parity perf compare: error: cannot write {exc.filename}: {exc.strerror}",
              file=sys.stderr)
        return 2


def _trend_plot(args, comp, budgets):
    """The history's trend PNG: --plot, else beside --markdown; never without --history."""
    if args.plot and not args.history:
        raise HarnessInputError("--plot draws the history's trend: give it with --history DIR")
    if not args.history or not (args.plot or args.markdown):
        return None
    markdown = Path(args.markdown) if args.markdown else None
    path = Path(args.plot) if args.plot else markdown.with_name(f"{markdown.stem}-trend.png")
    return draw_trend(comp, path, budgets)


def _relative(path: Path, start: Path) -> str:
    try:
        return str(path.resolve().relative_to(start.resolve()))
    except ValueError:
        return str(path.resolve())
