"""`gemma-parity bisect`: the first layer that breaks parity with a golden, its component and why."""

from __future__ import annotations

from harness.base.atomic import write_json_atomic
from harness.base.errors import OptionError
from harness.cli import validate as v
from harness.cli.host_gate import add_host_memory_arg, plan_gate, rows_of
from harness.cli.check import add_speculate_args, add_strict_precision_arg, validate_speculate
from harness.cli.snapshot_hooks import add_snapshot_args, after_run, validate_snapshot_args
from harness.cli.common import EXIT_FAIL, EXIT_OK, add_model_args, add_port_args, run_settings, with_generator


def add_command(sub) -> None:
    from harness.parity.bisect import MODES

    p = sub.add_parser(
        "bisect", help="find the first layer that breaks parity with a golden, its component and why",
        description="Compare the port with a golden layer by layer. capture mode (default on cpu) runs "
                    "the parity build once and each layer alone on the golden's input to it; truncate "
                    "mode (default on neuron) binary-searches builds of the first k layers. Exit 0 when "
                    "no layer diverges, 1 when one does, 2 on bad input.")
    add_model_args(p)
    p.add_argument("--golden", required=True, metavar="DIR",
                   help="golden written by `gemma-parity reference` (may be from other weights of the same spec)")
    p.add_argument("--mode", choices=list(MODES), default=None,
                   help="capture (default on cpu) or truncate (default on neuron: no extra graph outputs)")
    add_port_args(p, "write bisect.md, bisect.json and bisect_errors.png there", batch=True)
    add_host_memory_arg(p)
    add_speculate_args(p)  # with --assistant: the drafter's first failing point named too
    add_strict_precision_arg(p)
    add_snapshot_args(p, repro=True)
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness.inputs.prompts import validate_prompt_fit

    from harness.backends import backend_unavailable

    v._port_options(args)
    args.settings = run_settings(args)
    if (why := backend_unavailable(args.settings.backend)) is not None:  # before the reference's layers are built
        raise OptionError(why)
    if args.strict_precision and (args.mode or ("capture" if args.settings.backend == "cpu" else "truncate")) == "truncate":
        raise OptionError("--strict-precision with truncate mode: truncate builds judge no distribution of R and no "
                          "over-precision (they need the capture run's points); use --mode capture or drop "
                          "--strict-precision")
    inputs = v.model_inputs(args)
    inputs["--golden"] = v.input_path(args.golden, "--golden", want_dir=True)
    ckpt = v.port_run_outputs_and_checkpoint(args, inputs)
    golden = args.golden_read = v.check_golden_inputs(args, inputs, refuse_other_weights=False)
    validate_prompt_fit(golden.prompts, golden.new_tokens, f"golden {args.golden}", buckets=args.settings.buckets,
                        kv_len=args.settings.kv_len, max_positions=ckpt.spec.max_positions)
    validate_speculate(args, ckpt, [(len(p), golden.new_tokens) for p in golden.prompts])
    plan_gate(args, "bisect", ckpt.spec, rows_of(golden.prompts, golden.new_tokens), golden=True)
    validate_snapshot_args(args)


def run(args) -> int:
    from harness.parity.bisect import bisect_golden
    from harness.report.formats import format_bisect, write_report

    ckpt = args.ckpt
    print(ckpt.describe())
    result, payload = bisect_golden(ckpt, args.golden_read, args.settings, mode=args.mode, progress=True,
                                    strict_precision=args.strict_precision)
    distribution = result.check.stage("distribution") if result.check is not None else None
    if distribution is not None:  # the check's R distribution and over-precision (its verdict is in "passed")
        payload["distribution"] = distribution.to_json()
    text = format_bisect(payload) + _drafter(args, result, payload)
    payload = with_generator(payload, "bisect", args)
    if args.json is not None:  # the files first: a verdict is printed only once they are written
        write_json_atomic(args.json, payload)
    if args.report is not None:
        write_report(args.report, "bisect", payload, ckpt.spec)
    print(f"golden {args.golden}: {len(result.prompt_lengths)} prompt(s); written from "
          f"{'these same weights' if payload['golden_from_same_weights'] else 'other weights (checkpoint hashes differ)'}")
    print(text)
    if args.report is not None:
        print(f"report written to {args.report}")
    after_run(args, result.check, "bisect")
    return EXIT_OK if result.passed and payload.get("speculative", {}).get("passed", True) else EXIT_FAIL


def _drafter(args, result, payload: dict) -> str:
    """With --assistant: the speculative stage on the golden's prompts, and the drafter's first
    failing point (parity.speculative.first_drafter_point) in the payload and the text."""
    if getattr(args, "assistant_ckpt", None) is None:
        return ""
    from harness.parity.speculative import check_speculative, first_drafter_point

    calibration = result.check.bf16.calibration if result.check is not None else None  # capture mode's check
    stage = check_speculative(args.ckpt, args.golden_read.results("float32"), args.golden_read.results("bfloat16"),
                              calibration, settings=args.settings, assistant=args.assistant_ckpt, k=args.speculate).seal()
    first = first_drafter_point(stage)
    payload["speculative"] = dict(stage.to_json(), first_drafter_point=first)
    where = f"first divergent drafter point: {first['point']} ({first['ratio']:.3g}x)" if first else "drafter: every point passes"
    return f"\n{stage.describe()}\n{where}\n"
