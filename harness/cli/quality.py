"""`gemma-parity quality`: the port's next-token distributions over a corpus against a compact golden
of the fp32 reference, side by side with the bf16 reference (KL, delta-p, top-1, perplexity)."""

from __future__ import annotations

from pathlib import Path

from harness.base.atomic import write_json_atomic
from harness.base.errors import InputFileError, OptionError
from harness.cli import validate as v
from harness.cli.host_gate import add_host_memory_arg, plan_gate
from harness.cli.common import EXIT_FAIL, EXIT_OK, add_model_args, add_port_args, run_settings, with_generator
from harness.cli.output_paths import (_json_is_ours, clean_leftovers, output_location, replaceable_file,
                                      replaceable_report)


def add_command(sub) -> None:
    p = sub.add_parser(
        "quality", help="judge the port's distributions over a corpus against the fp32 and bf16 references",
        description="Teacher-force the port over a corpus cut into windows and compare its next-token "
                    "distributions with a golden of the fp32 reference (written here first, streamed one "
                    "layer at a time, resumable, optionally split into shards), side by side with the bf16 "
                    "reference. Exit 0 the port is no worse than bf16 by the stated factor, 1 it is, 2 bad input.")
    add_model_args(p)
    p.add_argument("--corpus", required=True, metavar="FILE",
                   help="a JSON list of token ids (or {\"ids\": [...]}), or text for the checkpoint's tokenizer")
    p.add_argument("--golden", required=True, metavar="DIR",
                   help="the corpus golden: written here when missing or incomplete (resumed), then read")
    p.add_argument("--window", type=int, default=None, help="tokens per teacher-forced window (default 64, or the golden's)")
    p.add_argument("--topk", type=int, default=None, help="fp32 log-probabilities kept per position (default 32, or the golden's)")
    p.add_argument("--windows-per-part", type=int, default=None,
                   help="windows per golden file, the resume granularity (default 16, or the golden's)")
    p.add_argument("--shard", metavar="I/N|auto[/N]", default=None,
                   help="write only shard I of N of the golden (0-based; one CI job each) and stop; `auto` takes I "
                        "(and N where set) from AWS Batch, Kubernetes indexed Job or Slurm array variables")
    p.add_argument("--reference-only", action="store_true", help="write the golden's missing shards and stop")
    add_port_args(p, "write quality.md, quality.json, quality_kl.png and worst_prompts.json there")
    add_host_memory_arg(p)
    p.set_defaults(func=run, validate=validate)


def _shard(text: str | None, existing: dict) -> tuple[int, int] | None:
    if text is None:
        return None
    if text.split("/")[0] == "auto":
        import os

        from harness.base.array_index import shard_from_environment

        return shard_from_environment(text, os.environ, existing.get("shards"))
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise OptionError(f"--shard {text!r}: expected I/N, e.g. 0/4 (shard 0 of 4)") from None
    if n < 1 or not 0 <= i < n:
        raise OptionError(f"--shard {text}: need N >= 1 and 0 <= I < N")
    return i, n


def _existing_settings(golden: Path) -> dict:
    from harness.quality.golden import SETTINGS_FILE
    from harness.quality.parts import checked_settings, read_own_json

    file = golden / SETTINGS_FILE
    if not file.exists():
        return {}
    return checked_settings(read_own_json(file, f"remove {golden} (or choose another --golden) and rerun"), file)


def _refuse_model(spec, backend: str) -> None:
    """What the reference pass or the port cannot run here, before any model work."""
    from harness.backends import backend_unavailable

    problem = backend_unavailable(backend)
    if problem:
        raise OptionError(f"--backend {backend}: {problem}")


def _outputs(args, inputs) -> None:
    outputs: dict = {}
    if args.json is not None:
        replaceable_file(output_location(args.json, "--json", False, inputs, outputs), "--json", _json_is_ours)
    if args.report is not None:
        replaceable_report(output_location(args.report, "--report", True, inputs, outputs), "--report", "quality")
    golden = output_location(args.golden, "--golden", True, inputs, outputs)
    shards = sorted(p for p in golden.glob("shard-*-of-*") if p.is_dir() and not p.is_symlink()) if golden.is_dir() else []
    clean_leftovers([*outputs.values(), *shards])  # a killed part write leaves its temp in the shard's directory


def validate(args) -> None:
    """Options, outputs, the checkpoint, the corpus and an existing golden's settings, in that order."""
    from harness.quality.golden import (DEFAULT_WINDOW, DEFAULT_WINDOWS_PER_PART, golden_settings, load_corpus,
                                        read_corpus, verify_golden)
    from harness.quality.judge import check_window_fits
    from harness.quality.stats import DEFAULT_TOPK

    if args.shard is not None or args.reference_only:  # they stop before the judged pass that --json/--report hold
        stop = "--shard" if args.shard is not None else "--reference-only"
        given = [flag for flag, value in (("--json", args.json), ("--report", args.report)) if value is not None]
        if given:
            raise OptionError(f"{' and '.join(given)} with {stop}: {stop} writes only the golden and stops, and "
                              f"{' and '.join(given)} hold the judged pass's verdict; drop {' and '.join(given)} here, "
                              "and give them to the judged run (`gemma-parity quality --golden DIR ...` without "
                              f"{stop}) once every shard is written")
    v._port_options(args)
    args.settings = run_settings(args)
    existing = _existing_settings(Path(args.golden))
    args.shard_pair = _shard(args.shard, existing)
    for name, default in (("window", DEFAULT_WINDOW), ("topk", DEFAULT_TOPK), ("windows_per_part", DEFAULT_WINDOWS_PER_PART)):
        if getattr(args, name) is None:
            setattr(args, name, existing.get(name, default))
    v._int_option(args, "window", 2)
    v._int_option(args, "windows_per_part", 1)
    if not 1 <= args.topk <= 256:
        raise OptionError(f"--topk {args.topk}: use 1 to 256 (32-64 keeps the golden compact)")
    inputs = v.model_inputs(args)
    inputs["--corpus"] = v.input_path(args.corpus, "--corpus", want_dir=False)
    if not inputs["--corpus"].is_file():  # a pipe nobody writes would hang the run; the corpus is read whole
        raise InputFileError(f"--corpus {args.corpus}: is a named pipe or device, not a regular file; save the "
                             "corpus to a file and give that")
    args.corpus_read = read_corpus(args.corpus)  # its shape before the checkpoint is opened
    _outputs(args, inputs)
    ckpt = v.open_checkpoint(args)
    v.check_tp(ckpt.spec, args.tp)
    v.check_kv_len(ckpt.spec, args.kv_len, "linear" if args.settings.backend != "neuron" else None)
    _refuse_model(ckpt.spec, args.settings.backend)
    check_window_fits(args.window, args.buckets, args.kv_len)
    args.corpus_ids = load_corpus(args.corpus, args.ckpt_dir, ckpt.spec, args.corpus_read)
    shards = args.shard_pair[1] if args.shard_pair else existing.get("shards", 1)
    args.golden_settings = golden_settings(ckpt, args.corpus_ids, args.window, topk=args.topk, shards=shards,
                                           windows_per_part=args.windows_per_part)
    verify_golden(args.golden, args.golden_settings, args.corpus_ids, ckpt.spec.vocab_size)
    plan_gate(args, "quality", ckpt.spec, golden=Path(args.golden).exists())


def run(args) -> int:
    from harness.quality.golden import golden_bytes, missing_shards, prepare_golden_dir, write_shard
    from harness.quality.judge import judge_corpus
    from harness.report.quality import format_quality, write_quality_report

    ckpt, settings = args.ckpt, args.golden_settings
    print(ckpt.describe())
    prepare_golden_dir(args.golden, settings)
    todo = [args.shard_pair[0]] if args.shard_pair else missing_shards(args.golden, settings)
    for shard in todo:
        write_shard(ckpt, args.corpus_ids, args.golden, settings, shard, progress=True)
        print(f"golden shard {shard}/{settings.shards} written to {args.golden} "
              f"({golden_bytes(args.golden) / 2**20:.2f} MiB so far)")
    if args.shard_pair or args.reference_only:
        left = missing_shards(args.golden, settings)
        print(f"reference pass done; shards still missing: {left or 'none'}"
              + ("" if left else f"; judge with `gemma-parity quality --golden {args.golden} ...`"))
        return EXIT_OK
    from harness.quality.stats import quality_factor

    payload = judge_corpus(ckpt, args.golden, settings, args.settings, progress=True,
                           factor=quality_factor(args.settings.quantize))  # docs/quantization.md
    if args.settings.quantize:  # the cost question, kept apart from check's structural one
        payload["quantize"] = args.settings.quantize
        payload["notes"].append(f"the port stores {args.settings.quantize} weights: this judges what quantization costs "
                                "against the unquantized model (the golden); whether the port is right is "
                                f"`check --quantize {args.settings.quantize}`'s question (docs/quantization.md)")
    kl_values = payload.pop("kl_values")
    payload = with_generator(payload, "quality", args)
    if args.json is not None:  # the files first: a verdict is printed only once they are written
        write_json_atomic(args.json, payload)
    if args.report is not None:
        write_quality_report(args.report, payload, kl_values)
    for flag, where in (("report", args.report), ("json", args.json)):
        if where is not None:
            print(f"{flag} written to {where}")
    print(format_quality(payload))
    return EXIT_OK if payload["passed"] else EXIT_FAIL
