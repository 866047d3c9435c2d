"""The one validation pass every command runs before any model work.

Each command's `validate(args)` checks every option and input with these, in a fixed order,
cheapest first: numbers and flag conflicts (and the run settings built from them); output
locations (the right kind, writable, not an input, nothing of the user's replaced); then the
checkpoint (opened, which builds the tiny model on first use) and everything judged against its spec: prompt ids, bucket and KV-length fit, a golden's integrity and
provenance. A refusal is a HarnessInputError (exit 2) naming the option, path or key and the fix.
What it opens is left on `args` for the command (`args.ckpt`, `args.prompt_ids`, ...), so nothing
is validated twice and nothing expensive starts before every check has passed.
"""

from __future__ import annotations

import math
import stat
import sys
from pathlib import Path

from harness.base.errors import HarnessInputError, InputFileError, OptionError, not_a_file
from harness.cli.output_paths import (_json_is_ours, clean_leftovers, output_location, replaceable_file,
                                      replaceable_report)


# ---- numbers and flags -------------------------------------------------------------------------

MAX_INT = 2 ** 62  # beyond any sensible count, and beyond what torch's seeds and sizes take


def _int_option(args, name: str, low: int, flag: str | None = None) -> int | None:
    value = getattr(args, name, None)
    flag = flag or "--" + name.replace("_", "-")
    if value is not None and value < low:
        raise OptionError(f"{flag} {value}: must be at least {low}")
    if value is not None and value > MAX_INT:
        raise OptionError(f"{flag} {value}: too large (at most {MAX_INT})")
    return value


def _finite(value: float, flag: str, low: float, high: float | None = None, low_open: bool = False) -> None:
    bad = not math.isfinite(value) or value < low or (low_open and value == low) or (
        high is not None and value >= high)
    if bad:
        span = f"{'(' if low_open else '['}{low:g}, {'∞' if high is None else f'{high:g}'})"
        raise OptionError(f"{flag} {value}: must be a finite number in {span}")


def refuse_nul(args) -> None:
    for name, value in vars(args).items():
        if isinstance(value, str) and "\0" in value:
            raise OptionError(f"--{name.replace('_', '-')} {value!r}: a path cannot contain a NUL byte")


def _dtype(args, allowed) -> None:
    if args.dtype not in allowed:
        raise OptionError(f"--dtype {args.dtype!r}: use one of {', '.join(sorted(allowed))}")


def _port_options(args) -> None:
    """--tp, --kv-len, --buckets, --dtype, --seed of check and bisect."""
    from harness.base.settings import DTYPES

    _int_option(args, "tp", 1)
    _int_option(args, "kv_len", 1)
    _int_option(args, "seed", 0)
    _dtype(args, DTYPES)
    if max(args.buckets) > args.kv_len:
        raise OptionError(f"--buckets {','.join(map(str, args.buckets))}: bucket {max(args.buckets)} exceeds "
                          f"--kv-len {args.kv_len}; buckets must fit the KV cache (raise --kv-len or use a "
                          "smaller bucket)")


# ---- inputs ------------------------------------------------------------------------------------

def input_path(value: str | None, flag: str, want_dir: bool) -> Path | None:
    """An input that must exist and be of the right kind (read errors are reported when read)."""
    if value is None:
        return None
    if not value.strip():
        raise OptionError(f"{flag}: empty path")
    path = Path(value)
    if not path.exists():
        raise InputFileError(f"{flag} {path}: not found; check the path")
    if want_dir and not path.is_dir():
        raise InputFileError(f"{flag} {path}: is not a directory; give the directory")
    if not want_dir and path.is_dir():
        raise InputFileError(f"{flag} {path}: is a directory; give the file")
    if not want_dir and not (path.is_file() or stat.S_ISFIFO(path.stat().st_mode)):
        raise InputFileError(f"{flag} {path}: is not a regular file ({not_a_file(path).removeprefix('is ')}); "
                             "give a file")
    return path


def model_inputs(args) -> dict[str, Path]:
    """The checkpoint this run reads: --checkpoint, or the tiny model's cache entry."""
    from harness.inputs.tiny import tiny_checkpoint_path

    if getattr(args, "config", None) is not None:
        return {"--config": input_path(args.config, "--config", want_dir=False)}
    if getattr(args, "checkpoint", None) is not None:
        return {"--checkpoint": input_path(args.checkpoint, "--checkpoint", want_dir=True)}
    from harness.cli.common import tiny_config

    return {"the tiny-model cache entry": tiny_checkpoint_path(getattr(args, "seed", 0) or 0, tiny_config(args))}


def open_checkpoint(args):
    from harness.cli.common import checkpoint_dir
    from harness.inputs.checkpoint import Checkpoint

    args.ckpt_dir = checkpoint_dir(args)
    args.ckpt = Checkpoint.open(args.ckpt_dir)
    return args.ckpt


def check_tp(spec, tp: int) -> None:
    from harness.base.errors import ShardingError
    from harness.port.sharding import plan_model

    try:
        plan_model(spec, tp)
    except ShardingError as exc:
        raise ShardingError(f"--tp {tp}: {exc} ({spec.source}); choose a tensor parallel degree the model's "
                            "head counts and sizes divide by (2 for the 12B on one inf2 chip)") from None


def check_kv_len(spec, kv_len: int | None, host_cache: str | None = None) -> None:
    """--kv-len against the model's positions; with `host_cache` (the sliding cache of a run that
    allocates the KV cache on this host: the cpu and xla backends) also against this host's memory."""
    if kv_len is not None and spec.max_positions is not None and kv_len > spec.max_positions:
        raise OptionError(f"--kv-len {kv_len}: more than the model's max_position_embeddings "
                          f"{spec.max_positions} ({spec.source}); use --kv-len {spec.max_positions} or less")
    if kv_len is not None and host_cache is not None:
        from harness.plan.kv_fit import refuse_kv_over_host

        try:
            refuse_kv_over_host(spec, kv_len, host_cache)
        except HarnessInputError as exc:
            raise OptionError(str(exc)) from None


def check_kv_fits(spec, tp: int, dtype: str, kv_len: int, sliding_cache: str = "linear") -> None:
    """--kv-len against one inf2 chip beside the weights (harness/plan/kv_fit.py), as an option error."""
    from harness.plan.kv_fit import refuse_kv_over_chip

    try:
        refuse_kv_over_chip(spec, tp, dtype, kv_len, sliding_cache)
    except HarnessInputError as exc:
        raise OptionError(str(exc)) from None


GOLDEN_VERSIONS = ("python", "torch", "transformers", "safetensors", "harness")  # what the reference's numbers depend on


def _warn_golden_provenance(where, manifest: dict) -> None:
    """A golden written under other versions (its provenance block's packages, or the older "versions"),
    or from a tree with uncommitted changes: its reference may differ from what this environment computes."""
    import harness
    from harness.base.provenance import package_versions

    recorded = dict(manifest.get("versions") or {}) if isinstance(manifest.get("versions"), dict) else {}
    prov = manifest.get("provenance") if isinstance(manifest.get("provenance"), dict) else {}
    if isinstance(prov.get("packages"), dict):
        recorded.update(prov["packages"])
    now = {**package_versions(), "harness": harness.__version__}
    differ = [f"{k} {recorded[k]} (now {now.get(k, 'absent')})" for k in GOLDEN_VERSIONS
              if k in recorded and recorded[k] != now.get(k)]
    if differ:
        print(f"gemma-parity: warning: golden {where} was written under {', '.join(differ)}; its reference can "
              "differ from this environment's by those versions' changes (rewrite it here to rule that out)",
              file=sys.stderr)
    git = prov.get("git") if isinstance(prov.get("git"), dict) else {}
    if git.get("dirty") is True:
        print(f"gemma-parity: note: golden {where} was written from a tree with uncommitted changes (commit "
              f"{str(git.get('commit'))[:12]}, dirty): no commit reproduces its reference", file=sys.stderr)


def check_golden_inputs(args, inputs, refuse_other_weights: bool):
    """Read and verify the golden for the checkpoint's spec; prompts and tokens come from it."""
    from harness.reference.golden import GoldenError, read_golden, same_weights

    from harness.inputs.prompts import validate_prompt_ids

    golden = read_golden(args.golden, expected_spec=args.ckpt.spec)
    golden.results("bfloat16")  # the noise envelope: check and bisect need it (refused here, not later)
    validate_prompt_ids(args.ckpt.spec, golden.prompts, f"golden {args.golden}")
    args.golden_same_weights = same_weights(golden, args.ckpt)
    _warn_golden_provenance(args.golden, golden.manifest)
    if args.golden_same_weights is None:
        print(f"gemma-parity: note: golden {args.golden} records no checkpoint hashes; whether it was written "
              "from these weights cannot be checked", file=sys.stderr)
    if refuse_other_weights and args.golden_same_weights is False:
        raise GoldenError(
            f"--golden {args.golden}: written from other weights than {args.ckpt_dir} (the safetensors "
            "files' sha256 differ), so the port cannot be judged against it: a difference would be the "
            "weights', not the port's. Regenerate it from these weights (`gemma-parity reference "
            f"--checkpoint {args.ckpt_dir} --out DIR`), or use `gemma-parity bisect`, which accepts a "
            "golden of other weights of the same architecture.")
    return golden


def port_run_outputs_and_checkpoint(args, inputs: dict[str, Path]):
    """For commands that run the port (check, bisect): --json and --report checked against the
    inputs, leftovers of killed runs cleaned, then the checkpoint opened and the TP degree and KV
    length judged against its spec. Returns the checkpoint."""
    outputs: dict = {}
    if args.json is not None:
        replaceable_file(output_location(args.json, "--json", False, inputs, outputs), "--json", _json_is_ours)
    if args.report is not None:
        replaceable_report(output_location(args.report, "--report", True, inputs, outputs), "--report", args.command)
    for flag, attr in (("--snapshot", "snapshot"), ("--emit-repro", "emit_repro")):  # new directories, written last
        if getattr(args, attr, None) is not None:  # not a link, not in or around an input or another output
            output_location(getattr(args, attr), flag, True, inputs, outputs)
    clean_leftovers(outputs.values())
    ckpt = open_checkpoint(args)
    # judged on the user's checkpoint (the quantized copy has its spec), before any copy is written
    check_tp(ckpt.spec, args.tp)
    on_host = getattr(args, "backend", None) != "neuron"  # the cpu and xla backends hold the cache here
    check_kv_len(ckpt.spec, args.kv_len, getattr(args, "sliding_cache", "linear") if on_host else None)
    if not on_host:  # the device's memory, before any compile
        check_kv_fits(ckpt.spec, args.tp, args.dtype, args.kv_len, args.sliding_cache)
    if getattr(args, "quantize", None):  # the structural truth: the quantized model itself (docs/quantization.md)
        from harness.cli.host_gate import gated_quantized_reference

        args.ckpt = ckpt = gated_quantized_reference(args, args.command, ckpt)  # exit 2 before the copy is written
    return ckpt
