"""`gemma-parity reference`: run the CPU fp32 and bf16 references and write a golden."""

from __future__ import annotations

import functools

from harness.base.atomic import claim_output
from harness.base.errors import OptionError, OutputError
from harness.cli import validate as v
from harness.cli.host_gate import add_host_memory_arg, plan_gate, rows_of
from harness.cli.common import EXIT_OK, add_model_args
from harness.cli.output_paths import clean_leftovers, output_location
from harness.inputs.prompts import DEFAULT_NEW_TOKENS


def add_command(sub) -> None:
    p = sub.add_parser("reference", help="run the CPU fp32 and bf16 reference and write a golden",
                       description="Run the CPU fp32 and bf16 references and write a golden. Exit 0, "
                                   "or 2 on bad input.")
    add_model_args(p)
    p.add_argument("--prompts", metavar="FILE", help="JSON list of token-id lists (or strings with a tokenizer)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"greedy tokens to decode (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--stream", action="store_true",
                   help="prefill captures one layer at a time (peak memory ~ embeddings + one layer); no decode")
    p.add_argument("--out", required=True, metavar="DIR", help="golden directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing golden deliberately (only a golden: never other files)")
    from harness.base.settings import QUANTIZE_CHOICES

    p.add_argument("--quantize", choices=list(QUANTIZE_CHOICES), default=None,
                   help="the golden of the quantized model (the structural truth of `check --quantize`, "
                        "docs/quantization.md)")
    add_host_memory_arg(p)
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness.inputs.prompts import load_prompts, validate_prompt_fit, validate_prompt_ids
    from harness.reference.golden import is_golden_dir
    from harness.reference.golden_write import check_replaceable
    from harness.reference.selfcheck import refuse_unsound_reference

    if args.stream and args.new_tokens is not None:
        raise OptionError(f"--new-tokens {args.new_tokens} with --stream: the streaming reference computes "
                          "prefill captures only and decodes nothing; drop one of them")
    if args.new_tokens is None:
        args.new_tokens = 0 if args.stream else DEFAULT_NEW_TOKENS
    v._int_option(args, "new_tokens", 0)
    v._int_option(args, "seed", 0)
    inputs = v.model_inputs(args)
    if args.prompts is not None:
        inputs["--prompts"] = v.input_path(args.prompts, "--prompts", want_dir=False)
    out = output_location(args.out, "--out", True, inputs, {})
    inside = next((d for d in out.resolve().parents if is_golden_dir(d)), None)
    if inside is not None:
        raise OutputError(f"--out {out}: is inside the golden {inside}; a golden holds only its own two "
                          "files. Choose a location outside it.")
    check_replaceable(out, args.overwrite)
    clean_leftovers([out])
    claim_output(out, "--out")  # a second run for the same --out is refused now, not after its work
    ckpt = v.open_checkpoint(args)
    if args.quantize:  # the quantized model's own checkpoint (harness/inputs/quantized_checkpoint.py)
        from harness.cli.host_gate import gated_quantized_reference

        args.ckpt = ckpt = gated_quantized_reference(args, "reference", ckpt)  # exit 2 before the copy is written
    if not args.stream:
        ckpt.check_inert_parts()  # the reference loads the whole checkpoint through transformers
    prompts = load_prompts(args.prompts, args.ckpt_dir)
    validate_prompt_ids(ckpt.spec, prompts, args.prompts)
    # run first by `run` (a streamed model is never loaded whole); a callable, not a setting of the provenance
    args.self_check = None if args.stream else functools.partial(refuse_unsound_reference, ckpt, prompts)
    validate_prompt_fit(prompts, args.new_tokens, args.prompts, max_positions=ckpt.spec.max_positions)
    plan_gate(args, "reference", ckpt.spec, rows_of(prompts, args.new_tokens), stream=args.stream)


def run(args) -> int:
    from harness.cli.common import run_provenance
    from harness.reference.golden_write import make_golden

    if getattr(args, "self_check", None) is not None:
        args.self_check()  # the reference checked against itself: exit 2
    # the same block as check's and bench's results (settings, input hashes, versions, commit, dirty)
    written = make_golden(args.ckpt.path if args.quantize else args.ckpt_dir, args.out, args.prompts, args.new_tokens, stream=args.stream,
                          overwrite=args.overwrite, progress=True, provenance=run_provenance(args))
    print(f"golden written to {written.path}: {len(written.prompts)} prompt(s), {written.new_tokens} new "
          f"token(s); fp32 tokens {written.tokens}")
    return EXIT_OK
