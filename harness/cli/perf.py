"""`gemma-parity bench` and `gemma-parity perf compare`: time the port, flag regressions."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.base.atomic import claim_output
from harness.base.errors import HarnessInputError, InputFileError, OptionError, OutputError, read_json_file
from harness.cli import validate as v
from harness.cli.host_gate import add_host_memory_arg, plan_gate
from harness.cli.check import add_speculate_args, validate_speculate
from harness.cli.common import EXIT_FAIL, EXIT_OK, add_run_args, run_settings, with_generator
from harness.inputs.prompts import kv_positions_used
from harness.perf.results import history_files, sample_problem, skipped_history_entries, validate_result
from harness.perf import (DEFAULT_ALPHA, DEFAULT_FACTOR, DEFAULT_NEW_TOKENS, DEFAULT_RUNS, DEFAULT_WARMUP, MAX_ALPHA,
                          append_history, compare_files, compare_history, parse_budgets, run_bench, write_json,
                          write_text)
from harness.report.perf_plot import draw_length, draw_trend
from harness.report.perf_text import render_bench_summary, render_markdown, render_text


def add_command(subparsers) -> None:
    """Add `bench` and `perf compare`; each sets `func(args) -> exit code` and its `validate`."""
    from harness.perf.bench import BENCH_SETTINGS

    bench = subparsers.add_parser(
        "bench", help="time prefill and decode; write a result file (and add it to a history)",
        description="Time prefill per bucket and decode per token. Exit 0 ok, 2 bad input.")
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (safetensors)")
    from harness.inputs.tiny import TINY_FAMILY

    source.add_argument("--model", choices=("tiny", *(f"tiny-{name}" for name in TINY_FAMILY)),
                        help="a cached tiny fixture model (tiny: 12B-shaped; tiny-31b, -e2b, -e4b, -26b-a4b)")
    add_run_args(bench, BENCH_SETTINGS)
    bench.add_argument("--runs", type=_runs_arg, default=DEFAULT_RUNS,
                       help="timed runs; p90 is reported from 10, p99 from 100 samples (default %(default)s); "
                            "`auto`: a pilot of 10 runs, then as many as resolve a 10%% change of every median "
                            "(harness/perf/resolution.py) within --time-cap seconds")
    bench.add_argument("--time-cap", type=float, default=AUTO_TIME_CAP_S,
                       help="with --runs auto: the most seconds of timed runs after the pilot (default %(default)s)")
    bench.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                       help="runs made first and discarded (default %(default)s)")
    bench.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                       help="decode steps per run after the headline prefill (default %(default)s)")
    bench.add_argument("--lengths", type=_lengths_arg, default=(), metavar="16,64,200",
                       help="also time TTFT at these prompt lengths (longer than a bucket: chunked prefill) and "
                       "TPOT decoding from them, each with its floor (metrics ttft_ms@L, tpot_ms@L)")
    bench.add_argument("--batch", type=_batches_arg, default=(), metavar="1,2,4,8",
                       help="also time batches of these sizes (a KV slot per sequence): tokens/s, per-token latency "
                            "and prefill per batch, each against the batch's roofline floor")
    add_host_memory_arg(bench)
    bench.add_argument("--out", required=True, metavar="FILE", help="result JSON (never overwritten "
                       "without --force, and then only a result file bench wrote)")
    bench.add_argument("--force", action="store_true", help="overwrite an existing --out result file")
    bench.add_argument("--history", metavar="DIR", help="also add the run to this history directory")
    add_speculate_args(bench)  # --assistant DIR --speculate K: speculative decode timed beside plain (perf/speculative.py)
    bench.set_defaults(func=run_bench_command, validate=validate_bench, seed=0)
    _add_compare(subparsers)


def _batches_arg(text: str) -> tuple[int, ...]:
    import argparse

    from harness.base.errors import OptionError
    from harness.base.settings import parse_buckets
    try:
        return parse_buckets(text)
    except OptionError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--buckets", "--batch")) from None


def _lengths_arg(text: str) -> tuple[int, ...]:
    import argparse

    from harness.perf.length import parse_lengths
    try:
        return parse_lengths(text)
    except HarnessInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_compare(subparsers) -> None:
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
    compare.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                         help="median slowdown ratio that may alert, finite and >= 1 (default %(default)s)")
    compare.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                         help=f"significance level, in (0, {MAX_ALPHA:g}): of each metric's rank test (the "
                              "ratio interval's level is 1 - 2 * alpha) and family-wise over the metrics tested "
                              "for change points (default %(default)s)")
    compare.add_argument("--allow-mismatch", action="store_true",
                         help="compare runs from different machines, specs or settings")
    compare.add_argument("--allow-output-change", action="store_true",
                         help="compare the timings even when the runs generated different tokens (by default "
                              "that fails: a run that computes something else is not a performance result)")
    compare.add_argument("--markdown", metavar="FILE", help="also write a Markdown report")
    compare.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    compare.add_argument("--plot", metavar="PNG", help="the trend plot: the history's runs, or the baseline and "
                         "current files' (default: <markdown stem>-trend.png beside --markdown; needs the plot extra)")
    compare.set_defaults(func=run_compare_command, validate=validate_compare)


# ---- validation ----------------------------------------------------------------------------------

def _is_bench_result(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        data = read_json_file(path, "file", HarnessInputError, "")
    except HarnessInputError:
        return False
    return isinstance(data, dict) and data.get("format") == 1 and {"machine", "metrics"} <= data.keys()


def validate_bench(args) -> None:
    if args.runs != "auto":
        v._int_option(args, "runs", 1)
    v._finite(args.time_cap, "--time-cap", 1.0)
    v._int_option(args, "warmup", 0)
    v._int_option(args, "new_tokens", 1)
    v._int_option(args, "tp", 1)
    v._int_option(args, "kv_len", 1)
    args.settings = run_settings(args)
    kv_len = args.kv_len
    if kv_positions_used(max(args.buckets), args.new_tokens + 1) > kv_len:  # the prefill's token, then the steps
        raise OptionError(f"--buckets {max(args.buckets)} + --new-tokens {args.new_tokens} exceed the KV length "
                          f"{kv_len}; use --kv-len {max(args.buckets) + args.new_tokens}, fewer new tokens or "
                          "a smaller bucket")
    if args.lengths and kv_positions_used(max(args.lengths), args.new_tokens + 1) > kv_len:
        raise OptionError(f"--lengths {max(args.lengths)} + --new-tokens {args.new_tokens} exceed the KV length "
                          f"{kv_len}; use --kv-len {max(args.lengths) + args.new_tokens}, shorter lengths or fewer "
                          "new tokens")
    inputs = v.model_inputs(args)
    outputs: dict = {}
    out = v.output_location(args.out, "--out", False, inputs, outputs)
    if out.exists() and not args.force:  # refuse before spending minutes benchmarking
        raise OutputError(f"--out {out}: already exists; pass --force to overwrite it or choose another --out")
    if out.exists():
        v.replaceable_file(out, "--out", _is_bench_result)
    if args.history is not None:
        v.output_location(args.history, "--history", True, inputs, outputs)
    v.clean_leftovers(outputs.values())
    claim_output(out, "--out")  # a second bench for the same --out is refused now, not after its runs
    ckpt = v.open_checkpoint(args)
    v.check_tp(ckpt.spec, args.tp)
    v.check_kv_len(ckpt.spec, kv_len, getattr(args, "sliding_cache", "linear") if args.backend != "neuron" else None)
    plan_gate(args, "bench", ckpt.spec)
    validate_speculate(args, ckpt, [(min(args.settings.buckets), args.new_tokens)])  # the bench prompt


def _check_result_file(path: Path) -> None:
    data = read_json_file(path, "perf result", HarnessInputError, "delete it or re-run the benchmark")
    problem = sample_problem(data, str(path))
    if problem:
        raise HarnessInputError(problem)
    validate_result(data, str(path))


def validate_compare(args) -> None:
    v._finite(args.factor, "--factor", 1.0)
    v._finite(args.alpha, "--alpha", 0.0, MAX_ALPHA, low_open=True)
    names = [str(item).partition("=")[0].strip() for item in args.budget]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise OptionError(f"--budget {twice[0]}: given more than once; give each metric's ceiling once")
    args.budgets = parse_budgets(args.budget)
    if args.history and not (args.baseline or args.current):
        if not Path(args.history).exists():
            raise InputFileError(f"--history {args.history}: history directory not found; create it with "
                                 f"`gemma-parity bench ... --history {args.history}`")
        history = v.input_path(args.history, "--history", want_dir=True)
        inputs = {"--history": history}
        files = history_files(history)
        for entry in skipped_history_entries(history):
            print(f"gemma-parity: note: {entry}: not a regular file, so not a run; skipped", file=sys.stderr)
    elif args.baseline and args.current and not args.history:
        inputs = {flag: v.input_path(val, flag, want_dir=False)
                  for flag, val in (("--baseline", args.baseline), ("--current", args.current))}
        files = list(inputs.values())
    else:
        raise OptionError("give --baseline FILE and --current FILE, or --history DIR alone")
    for file in files:
        _check_result_file(file)
    outputs: dict = {}
    if args.markdown is not None:
        v.replaceable_file(v.output_location(args.markdown, "--markdown", False, inputs, outputs), "--markdown",
                           v._markdown_is_ours)
    if args.markdown is not None:  # the plots beside it: only ones an earlier run drew are replaced
        for png, what in ((_length_png(args.markdown), "length plot"), (_trend_png(args.markdown), "trend plot")):
            if png.exists() and (what == "length plot" or not args.plot):
                v.replaceable_file(png, f"--markdown's {what}", _png_is_ours)
    if args.json is not None:
        v.replaceable_file(v.output_location(args.json, "--json", False, inputs, outputs), "--json", v._json_is_ours)
    if args.plot is not None:
        plot = v.output_location(args.plot, "--plot", False, inputs, outputs)
        if plot.exists():  # only a PNG (a trend plot of an earlier run) is replaced
            v.replaceable_file(plot, "--plot", _png_is_ours)
    v.clean_leftovers(outputs.values())


# ---- running -------------------------------------------------------------------------------------

AUTO_PILOT_RUNS, AUTO_TIME_CAP_S = 10, 600.0


def _runs_arg(text: str):
    return "auto" if text == "auto" else int(text)


def _auto_runs(args) -> int:
    """--runs auto: a pilot run measures the spread and the time per run; the real run takes as
    many runs as resolve a 10% change of every median (alpha 0.01, power 0.8), within the cap."""
    import time

    from harness.perf.resolution import STATED_CHANGE, runs_for
    from harness.perf.results import metric_samples

    start = time.monotonic()
    pilot = run_bench(args.ckpt, args.settings, runs=AUTO_PILOT_RUNS, warmup=args.warmup,
                      new_tokens=args.new_tokens, progress=True, lengths=args.lengths)
    per_run = (time.monotonic() - start) / (AUTO_PILOT_RUNS + args.warmup)
    need = max(runs_for(s, s, 0.01, STATED_CHANGE) for s in metric_samples(pilot).values() if len(s) > 1)
    runs = max(AUTO_PILOT_RUNS, min(need, int(args.time_cap / max(per_run, 1e-6))))
    print(f"gemma-parity: --runs auto: the pilot's spread needs {need} runs to resolve {STATED_CHANGE:.0%}; "
          f"running {runs}{' (the --time-cap allows no more)' if runs < need else ''}", file=sys.stderr)
    return runs


def run_bench_command(args) -> int:
    runs = _auto_runs(args) if args.runs == "auto" else args.runs
    result = run_bench(args.ckpt, args.settings, runs=runs, warmup=args.warmup, new_tokens=args.new_tokens,
                       progress=True, lengths=args.lengths)
    from harness.cli.common import run_provenance

    result["provenance"] = run_provenance(args)
    if result["provenance"]["git"]["dirty"]:
        print(f"gemma-parity: note: the tree has uncommitted changes; {args.out} records commit "
              f"{str(result.get('git_commit'))[:12]} with dirty: true", file=sys.stderr)
    if args.batch:
        from harness.perf.batch import run_batch_bench
        from harness.report.bench import render_batch_bench

        result["batch"] = run_batch_bench(args.ckpt, args.settings, args.batch, runs=args.runs,
                                          new_tokens=args.new_tokens, prompt_len=min(args.settings.buckets))
    from harness.perf.speculative import speculative_block
    from harness.report.bench import render_speculative

    block = speculative_block(args.ckpt, args.settings, args.assistant_ckpt, args.speculate, runs=runs,
                              new_tokens=args.new_tokens)  # with --assistant: the "speculative" block, printed
    if block:
        print(render_speculative(block["speculative"]), end="")
    result.update(block)
    if args.settings.quantize:  # the unquantized build beside it, in this run (docs/quantization.md)
        from harness.perf.quantized import beside_unquantized, render_beside

        result["quantize"] = args.settings.quantize
        result["unquantized"] = beside_unquantized(args.ckpt, args.settings, result, runs=runs, warmup=args.warmup,
                                                   new_tokens=args.new_tokens, lengths=args.lengths)
    write_json(args.out, result, overwrite=args.force)
    print(render_bench_summary(result), end="")
    if args.settings.quantize:
        print(render_beside(result), end="")
    if args.batch:
        print(render_batch_bench(result["batch"]["rows"]), end="")
    print(f"wrote {args.out}", file=sys.stderr)
    if args.history is not None:
        print(f"added {append_history(result, args.history)}", file=sys.stderr)
    return EXIT_OK


def run_compare_command(args) -> int:
    options = dict(factor=args.factor, alpha=args.alpha, budgets=args.budgets, allow_mismatch=args.allow_mismatch,
                   allow_output_change=args.allow_output_change)
    if args.history is not None:
        comp = compare_history(args.history, **options)
    else:
        comp = compare_files(args.baseline, args.current, **options)
    _warn_provenance(args)
    plot = _trend_plot(args, comp, args.budgets)
    if args.markdown:  # latency against length, beside the Markdown (a run benched with --lengths)
        draw_length(comp, _length_png(args.markdown))
    print(render_text(comp), end="")
    if args.markdown:  # a report, rewritten each run
        link = None if plot is None else _relative(plot, Path(args.markdown).parent)
        write_text(args.markdown, render_markdown(comp, link) + f"\n{v.MARKDOWN_MARK}\n", overwrite=True)
    if args.json is not None:
        write_json(args.json, with_generator(comp.to_dict(), "perf compare"), overwrite=True)
    return EXIT_FAIL if comp.failed else EXIT_OK


def _warn_provenance(args) -> None:
    """A warning when the two runs compared were produced under different settings or versions."""
    import json

    from harness.base.provenance import differences

    if args.history is not None:
        return  # a history's runs span commits by design; its changes are the point
    blocks = []
    for path in (args.baseline, args.current):
        try:
            blocks.append(json.loads(Path(path).read_text()).get("provenance"))
        except (OSError, ValueError, AttributeError, RecursionError):
            blocks.append(None)
    differ = differences(*blocks)
    if differ:
        print(f"gemma-parity: warning: baseline and current ran under different settings or versions: "
              f"{'; '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}", file=sys.stderr)


def _trend_plot(args, comp, budgets):
    """The trend PNG (the history's runs, or the two files'): --plot, else beside --markdown."""
    if not (args.plot or args.markdown):
        return None
    markdown = Path(args.markdown) if args.markdown else None
    path = Path(args.plot) if args.plot else _trend_png(markdown)
    return draw_trend(comp, path, budgets)


def _png_is_ours(path: Path) -> bool:
    """A PNG this tool drew: its tEXt chunk names the software (harness/report/perf_plot.py)."""
    from harness.report.perf_plot import PNG_SOFTWARE

    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head[:8] == b"\x89PNG\r\n\x1a\n" and b"Software\x00" + PNG_SOFTWARE.encode() in head


def _trend_png(markdown) -> Path:
    markdown = Path(markdown)
    return markdown.with_name(f"{markdown.stem}-trend.png")


def _length_png(markdown) -> Path:
    markdown = Path(markdown)
    return markdown.with_name(f"{markdown.stem}-length.png")


def _relative(path: Path, start: Path) -> str:
    try:
        return str(path.resolve().relative_to(start.resolve()))
    except ValueError:
        return str(path.resolve())
