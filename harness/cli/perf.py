"""`gemma-parity bench`: time the port (prefill, decode, lengths, batches, speculation) and write a
result file, optionally into a history. (`perf compare`, which flags regressions between such
files, is harness/cli/perf_compare.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.base.atomic import claim_output
from harness.base.errors import HarnessInputError, OptionError, OutputError
from harness.cli import validate as v
from harness.cli.host_gate import add_host_memory_arg, plan_gate
from harness.cli.check import add_speculate_args, validate_speculate
from harness.cli.common import EXIT_OK, add_run_args, run_settings
from harness.cli.output_paths import clean_leftovers, json_dict_or_none, output_location, replaceable_file
from harness.inputs.prompts import kv_positions_used
from harness.perf import DEFAULT_NEW_TOKENS, DEFAULT_RUNS, DEFAULT_WARMUP, append_history, run_bench, write_json
from harness.report.perf_text import render_bench_summary


def add_command(subparsers) -> None:
    """Add `bench`; it sets `func(args) -> exit code` and its `validate`."""
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


# ---- validation ----------------------------------------------------------------------------------

def _is_bench_result(path: Path) -> bool:
    data = json_dict_or_none(path)
    return data is not None and data.get("format") == 1 and {"machine", "metrics"} <= data.keys()


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
    out = output_location(args.out, "--out", False, inputs, outputs)
    if out.exists() and not args.force:  # refuse before spending minutes benchmarking
        raise OutputError(f"--out {out}: already exists; pass --force to overwrite it or choose another --out")
    if out.exists():
        replaceable_file(out, "--out", _is_bench_result)
    if args.history is not None:
        output_location(args.history, "--history", True, inputs, outputs)
    clean_leftovers(outputs.values())
    claim_output(out, "--out")  # a second bench for the same --out is refused now, not after its runs
    ckpt = v.open_checkpoint(args)
    v.check_tp(ckpt.spec, args.tp)
    v.check_kv_len(ckpt.spec, kv_len, getattr(args, "sliding_cache", "linear") if args.backend != "neuron" else None)
    validate_speculate(args, ckpt, [(min(args.settings.buckets), args.new_tokens)])  # the bench prompt
    plan_gate(args, "bench", ckpt.spec)  # with the assistant's verify and draft graphs


# ---- running -------------------------------------------------------------------------------------

AUTO_PILOT_RUNS, AUTO_TIME_CAP_S = 10, 600.0


def _runs_arg(text: str):
    return "auto" if text == "auto" else int(text)


def _auto_runs(args) -> int:
    """--runs auto: a pilot run measures the spread and the time per run; the real run takes as
    many runs as resolve a 10% change of every median (alpha 0.01, power 0.8), within the cap."""
    import time

    from harness.perf.resolution import STATED_CHANGE, runs_for
    from harness.perf.samples import metric_samples

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
    from harness.perf import environment

    started = environment.probe()  # what else the machine ran during this bench (perf/environment.py)
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
                                          new_tokens=args.new_tokens, prompt_len=min(args.settings.buckets),
                                          assistant=args.assistant_ckpt)
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
    result["environment"] = environment.since(started)
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
