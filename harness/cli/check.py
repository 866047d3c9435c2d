"""`gemma-parity check`: run the port and compare every layer and token with the reference."""

from __future__ import annotations

from harness.base.atomic import write_json_atomic
from harness.base.errors import OptionError
from harness.cli import validate as v
from harness.cli.host_gate import add_host_memory_arg, plan_gate, rows_of
from harness.cli.snapshot_hooks import add_snapshot_args, after_run, validate_snapshot_args
from harness.cli.common import EXIT_FAIL, EXIT_OK, add_model_args, add_port_args, assistant_dir, run_settings, with_generator
from harness.inputs.prompts import DEFAULT_NEW_TOKENS


# the backends whose drafter reads each sequence's own KV slot (`serves_slots`): speculation in a batch
# (all three today: neuron's batched draft graphs take the drafting slot, backends/neuron_drafter.py);
# a backend whose drafter reads one sequence's cache would be refused --batch N with an assistant
SLOT_DRAFTERS = ("cpu", "xla", "neuron")


def add_command(sub) -> None:
    p = sub.add_parser("check", help="run the port and compare every layer and token with the reference",
                       description="Run the port and compare every layer and token with the CPU fp32 "
                                   "reference; without --batch the prompts then also run as one ragged batch "
                                   "(the batch stage, docs/batch.md). Exit 0 parity holds, 1 it does not, 2 bad input.")
    add_model_args(p)
    p.add_argument("--golden", metavar="DIR", help="reuse a golden of these weights instead of recomputing "
                   "the reference (its prompts and token count are used)")
    p.add_argument("--prompts", metavar="FILE", help="JSON list of token-id lists (default: fixtures/prompts/default.json)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"greedy tokens to decode (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--skip-fp32-stage", action="store_true",
                   help="skip the fp32 structural stage (it holds the model in fp32 on the host)")
    p.add_argument("--skip-served-build", action="store_true",
                   help="do not run and judge the perf build bench times (the served build); said in the result")
    add_strict_precision_arg(p)
    p.add_argument("--verbose", action="store_true", help="print the wall time of each stage and phase "
                   "(always in the JSON under \"seconds\")")
    add_port_args(p, "write a Markdown summary, the JSON and a PNG plot", batch=True)
    p.set_defaults(batch=None)  # no --batch: batch 1, then the prompts as one ragged batch (the batch stage)
    add_speculate_args(p)
    add_host_memory_arg(p)
    add_snapshot_args(p)
    p.set_defaults(func=run, validate=validate)


def add_strict_precision_arg(p) -> None:
    p.add_argument("--strict-precision", action="store_true",
                   help="over-precision (a point computed closer to fp32 than bf16 can be: an extra fp32 stretch "
                        "the device pays for) fails instead of warning (docs/judging.md#over-precision)")


def add_speculate_args(p) -> None:
    p.add_argument("--assistant", metavar="DIR", help="the target's Gemma-4 assistant checkpoint: also run and "
                   "judge speculative decoding with it (with --speculate; docs/speculative.md); `tiny` (`tiny-31b`): "
                   "the embedded assistant of --model tiny (tiny-31b), built and cached on first use")
    p.add_argument("--speculate", type=int, default=None, metavar="K",
                   help="draft length of speculative decoding (tokens drafted per verify call; with --assistant)")


def validate_speculate(args, ckpt, rows=()) -> None:
    """--assistant and --speculate go together; the assistant is checked against the target now, and
    every (prompt length, new tokens) of `rows` against the cache (each verify is padded to K+1
    rows). Sets the run settings' `speculate` (the build's verify graph)."""
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint
    from harness.port.speculate import check_speculate, check_verify_fit

    args.assistant_ckpt = None
    if args.assistant is None and args.speculate is None:
        return
    if args.assistant is None or args.speculate is None:
        given, missing = ("--assistant", "--speculate K") if args.speculate is None else ("--speculate", "--assistant DIR")
        raise OptionError(f"{given} needs {missing}: speculative decoding drafts with the assistant K tokens per verify")
    check_speculate(args.speculate, args.settings)
    widest = max(args.batch or (1,)) if isinstance(args.batch, tuple) else (args.batch or 1)
    if widest > 1 and args.settings.backend not in SLOT_DRAFTERS:
        raise OptionError(f"--assistant with --batch {widest} on the {args.settings.backend} backend: its drafter reads "
                          f"a single sequence's KV cache (the {', '.join(SLOT_DRAFTERS)} backends' draft from each "
                          f"sequence's own slot); drop --batch or use --backend {' or '.join(SLOT_DRAFTERS)}")
    args.settings = args.settings.but(speculate=args.speculate)
    for prompt_len, new_tokens in rows:
        check_verify_fit(prompt_len, new_tokens, args.speculate, args.settings.kv_len)
    args.assistant = assistant_dir(args)  # a directory, or `tiny`: the embedded tiny target's assistant
    args.assistant_ckpt = AssistantCheckpoint.open(v.input_path(args.assistant, "--assistant", True), ckpt.spec)
    # every build of the run is the one with the drafter (on neuron its graphs are the target's: one compile)
    args.settings = args.settings.but(assistant=str(args.assistant_ckpt.path))


def validate(args) -> None:
    """Options, outputs, then the checkpoint and (golden or prompts) against its spec."""
    from harness.inputs.prompts import load_prompts, validate_prompt_fit, validate_prompt_ids

    if args.golden is not None and (args.prompts is not None or args.new_tokens is not None):
        given = " and ".join(f for f, val in (("--prompts", args.prompts), ("--new-tokens", args.new_tokens))
                             if val is not None)
        raise OptionError(f"--golden {args.golden} fixes the prompts and the number of new tokens; drop "
                          f"{given} (or drop --golden to recompute the reference for them)")
    if args.new_tokens is None:
        args.new_tokens = DEFAULT_NEW_TOKENS
    v._int_option(args, "new_tokens", 0)
    # docs/batch.md#the-judge-per-sequence; on neuron the batch stage (its graphs at 3 batch buckets)
    # is asked for with --batch N: a device's first run compiles only what it must (compile_budget.py)
    args.batch_stage = args.batch is None and args.backend != "neuron"
    args.batch_note = "on neuron the batch stage is asked for with --batch N" if args.batch is None else "--batch 1"
    args.batch = 1 if args.batch is None else args.batch
    v._port_options(args)
    args.settings = run_settings(args)
    inputs = v.model_inputs(args)
    inputs.update({flag: v.input_path(val, flag, want_dir)
                   for flag, val, want_dir in (("--golden", args.golden, True), ("--prompts", args.prompts, False))
                   if val is not None})
    ckpt = v.port_run_outputs_and_checkpoint(args, inputs)
    if args.golden:
        golden = v.check_golden_inputs(args, inputs, refuse_other_weights=True)
        prompts, new_tokens, source = golden.prompts, golden.new_tokens, f"golden {args.golden}"
        args.reference_source, args.prompt_ids = golden, None  # read and verified once, here
    else:
        ckpt.check_inert_parts()  # the reference loads the whole checkpoint through transformers
        prompts = load_prompts(args.prompts, args.ckpt_dir)
        validate_prompt_ids(ckpt.spec, prompts, args.prompts)
        new_tokens, source = args.new_tokens, args.prompts
        args.reference_source, args.prompt_ids = None, prompts
    validate_prompt_fit(prompts, new_tokens, source, buckets=args.settings.buckets, kv_len=args.settings.kv_len,
                        max_positions=ckpt.spec.max_positions)
    validate_speculate(args, ckpt, [(len(p), new_tokens) for p in prompts])
    plan_gate(args, "check", ckpt.spec, rows_of(prompts, new_tokens), golden=bool(args.golden),
              fp32_stage=not args.skip_fp32_stage, served=not args.skip_served_build, batch_stage=args.batch_stage)
    validate_snapshot_args(args)


def batch_checks(args) -> tuple:
    """The batch stage of a check without --batch; with --batch 1, the result says it did not run
    (with --batch N > 1 the stages themselves ran the prompts as a batch)."""
    from harness.parity.batched import batch_stage

    if args.settings.batch > 1:
        return ()
    skip = None if args.batch_stage else f"{args.batch_note}: the prompts ran one at a time only"
    return (batch_stage(args.settings, progress=True, skip=skip),)


def run(args) -> int:
    from harness.parity.check import run_parity_check
    from harness.parity.served import served_stage
    from harness.parity.speculative import speculative_stage
    from harness.reference.selfcheck import refuse_unsound_reference
    from harness.report.formats import format_check, write_report

    import time

    ckpt = args.ckpt
    print(ckpt.describe())
    refuse_unsound_reference(ckpt, args.prompt_ids or args.reference_source.prompts)  # exit 2
    before_run = time.perf_counter()
    extra = batch_checks(args) + (served_stage(args.settings, progress=True, skip=args.skip_served_build),)
    if args.assistant_ckpt is not None:
        extra += (speculative_stage(args.settings, args.assistant_ckpt, args.speculate),)
    result = run_parity_check(ckpt, args.ckpt_dir, args.settings, golden=args.reference_source,
                              prompts=args.prompt_ids, new_tokens=args.new_tokens, progress=True,
                              fp32_stage=not args.skip_fp32_stage, stages=extra,
                              strict_precision=args.strict_precision)
    payload = with_generator(result.to_json(), "check", args)
    # The files first: a verdict is printed only once everything asked for is written, so that
    # "PARITY PASS" is never followed by an exit status other than 0.
    if args.json is not None:
        write_json_atomic(args.json, payload)
    if args.report is not None:
        write_report(args.report, "check", payload, ckpt.spec)
    for flag, where in (("report", args.report), ("json", args.json)):
        if where is not None:
            print(f"{flag} written to {where}")
    result.run_seconds.update(before=round(before_run - args.started, 2),  # input checks, reference self-check
                              command=round(time.perf_counter() - args.started, 2))
    # the served build's verdict (and other extra stages') after the layer table, before the verdict lines
    print(format_check(result, verbose=args.verbose, extra=tuple(s.describe() for s in result.extra_stages)))
    after_run(args, result, "check")
    return EXIT_OK if result.passed else EXIT_FAIL
