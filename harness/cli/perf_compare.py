"""`gemma-parity perf compare`: a current run against a baseline or a history's; regressions,
broken budgets and change points, written as text, Markdown, JSON and the trend and length plots.
(`bench`, which writes the runs compared, is harness/cli/perf.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.base.errors import HarnessInputError, InputFileError, OptionError, read_json_file
from harness.cli import validate as v
from harness.cli.common import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK, with_generator
from harness.cli.output_paths import (MARKDOWN_MARK, _json_is_ours, _markdown_is_ours, clean_leftovers, output_location,
                                      replaceable_file)
from harness.perf import (DEFAULT_ALPHA, DEFAULT_FACTOR, MAX_ALPHA, compare_files, compare_history, parse_budgets,
                          write_json, write_text)
from harness.perf.results import history_files, sample_problem, skipped_history_entries, validate_result
from harness.report.perf_plot import draw_length, draw_trend
from harness.report.perf_text import render_markdown, render_text


def add_command(subparsers) -> None:
    """Add `perf compare`; it sets `func(args) -> exit code` and its `validate`."""
    perf = subparsers.add_parser("perf", help="compare benchmark results")
    perf_commands = perf.add_subparsers(dest="perf_command", metavar="{compare}", required=True)
    compare = perf_commands.add_parser(
        "compare", help="flag regressions and broken budgets",
        description="Compare a current run with a baseline. Exit 0 ok, 1 regression or broken "
                    "budget, 2 bad input or runs not comparable (the machine's other work differed: "
                    "docs/performance.md#comparable-runs).")
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
        replaceable_file(output_location(args.markdown, "--markdown", False, inputs, outputs), "--markdown",
                         _markdown_is_ours)
    if args.markdown is not None:  # the plots beside it: only ones an earlier run drew are replaced
        for png, what in ((_length_png(args.markdown), "length plot"), (_trend_png(args.markdown), "trend plot")):
            if png.exists() and (what == "length plot" or not args.plot):
                replaceable_file(png, f"--markdown's {what}", _png_is_ours)
    if args.json is not None:
        replaceable_file(output_location(args.json, "--json", False, inputs, outputs), "--json", _json_is_ours)
    if args.plot is not None:
        plot = output_location(args.plot, "--plot", False, inputs, outputs)
        if plot.exists():  # only a PNG (a trend plot of an earlier run) is replaced
            replaceable_file(plot, "--plot", _png_is_ours)
    clean_leftovers(outputs.values())


# ---- running -------------------------------------------------------------------------------------

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
        write_text(args.markdown, render_markdown(comp, link) + f"\n{MARKDOWN_MARK}\n", overwrite=True)
    if args.json is not None:
        write_json(args.json, with_generator(comp.to_dict(), "perf compare"), overwrite=True)
    if comp.failed:
        return EXIT_FAIL
    if comp.not_comparable:  # neither a pass nor a regression: the runs say nothing about the code
        print(f"gemma-parity: {comp.not_comparable}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


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
