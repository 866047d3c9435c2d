"""What every command shares: exit codes, the model arguments, the run-settings arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

# The exit-code contract CI reads (README "Exit status"): 0 parity holds (or no regression),
# 1 parity fails (or a regression, or a broken budget) and nothing else, 2 bad input or an
# environment problem (the message names the path, key or option and the fix), 70 an internal
# error of gemma-parity (a bug: the traceback is written to a file), 130 interrupted (Ctrl-C),
# 143 terminated (SIGTERM).
EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERNAL = 70  # EX_SOFTWARE in sysexits.h
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
EXIT_PIPE = 141  # stdout closed by its reader (`| head`): 128 + SIGPIPE, what a shell reports for such a tool


def add_model_args(p, config: bool = False) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", metavar="DIR", help="local checkpoint directory (config.json + *.safetensors)")
    if config:
        group.add_argument("--config", metavar="FILE", help="a config.json (no weights needed)")
    from harness.inputs.tiny import TINY_FAMILY

    group.add_argument("--model", choices=["tiny", *(f"tiny-{name}" for name in TINY_FAMILY)],
                       help="an embedded tiny model, built and cached on first use: `tiny` is 12B-shaped, "
                            "tiny-31b, tiny-e2b, tiny-e4b and tiny-26b-a4b the family's shapes")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model (default 0)")


def tiny_config(args) -> Path:
    """The tiny model's config for --model (tiny: the 12B's shape; tiny-NAME: harness.inputs.tiny.TINY_FAMILY)."""
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY

    model = getattr(args, "model", None) or "tiny"
    return TINY_CONFIG if model == "tiny" else TINY_FAMILY[model.removeprefix("tiny-")]


def checkpoint_dir(args) -> Path:
    from harness.inputs.tiny import tiny_checkpoint

    if getattr(args, "checkpoint", None):
        return Path(args.checkpoint)
    return tiny_checkpoint(seed=args.seed, config_path=tiny_config(args))


def tiny_assistant_names() -> dict:
    """The embedded tiny assistants `--assistant` takes by name: {name: its target's tiny config}
    (`tiny` for --model tiny; `tiny-31b` for --model tiny-31b; the other variants have none)."""
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY
    from harness.reference.tiny_assistant import TINY_ASSISTANTS

    names = {"tiny": TINY_CONFIG, **{f"tiny-{name}": config for name, config in TINY_FAMILY.items()}}
    return {name: config for name, config in names.items() if config in TINY_ASSISTANTS}


def assistant_dir(args) -> str:
    """--assistant: a directory as given, or the name of an embedded tiny assistant (`tiny`,
    `tiny-31b`): the fitted assistant of the --model of the same name, built and cached on first use
    like the tiny model (harness/reference/tiny_assistant.py)."""
    from harness.base.errors import OptionError

    names = tiny_assistant_names()
    value = args.assistant
    if value not in names:
        if value.startswith("tiny-") and not Path(value).exists():
            raise OptionError(f"--assistant {value}: no such directory, and no embedded tiny assistant of that name "
                              f"(the embedded ones: {', '.join(names)}; the other tiny variants have no assistant)")
        return value
    if Path(value).exists():
        raise OptionError(f"--assistant {value}: both the embedded tiny assistant and a path of that name; "
                          f"write ./{value} for the path")
    model = None if getattr(args, "checkpoint", None) or getattr(args, "config", None) else (args.model or "tiny")
    if model != value:
        target = f"--model {model}" if model else "--checkpoint" if getattr(args, "checkpoint", None) else "--config"
        raise OptionError(f"--assistant {value} is the assistant of the embedded --model {value}, not of {target}: "
                          f"use --model {value} with it, or give the assistant's directory")
    from harness.reference.tiny_assistant import tiny_assistant

    return str(tiny_assistant(seed=args.seed, target_config=names[value])[1])


def buckets_arg(text: str) -> tuple[int, ...]:
    from harness.base.errors import OptionError
    from harness.base.settings import parse_buckets

    try:
        return parse_buckets(text)
    except OptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dtype_arg(text: str) -> str:
    """Any name of the dtype vocabulary (bf16, bfloat16, fp32, float32) -> the canonical name."""
    from harness.base.errors import OptionError
    from harness.base.settings import dtype_name

    try:
        return dtype_name(text)
    except OptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


RUN_ARGS = ("backend", "tp", "dtype", "buckets", "kv_len", "sliding_cache", "quantize", "backend_options")


def add_run_args(p, defaults=None, fields=RUN_ARGS, purpose: str = "port dtype") -> None:
    """The run-settings options `fields` of a command, their defaults taken from `defaults` (a
    RunSettings; the settings' own defaults when None). `run_settings(args)` reads them back."""
    from harness.backends import BACKENDS
    from harness.base.settings import DTYPES, RunSettings

    d = defaults or RunSettings()
    if "backend" in fields:
        p.add_argument("--backend", choices=list(BACKENDS), default=d.backend,
                       help=f"what runs the port: cpu (here and in CI), xla, neuron (inf2) (default {d.backend})")
    if "tp" in fields:
        p.add_argument("--tp", type=int, default=d.tp, help=f"tensor parallel degree (default {d.tp})")
    if "dtype" in fields:
        names = ", ".join(f"{name} ({short})" for name, (short, _) in DTYPES.items())
        p.add_argument("--dtype", type=dtype_arg, default=d.dtype, metavar="DTYPE",
                       help=f"{purpose}: {names} (default {d.dtype})")
    if "buckets" in fields:
        p.add_argument("--buckets", type=buckets_arg, default=d.buckets, metavar="16,64",
                       help=f"prefill buckets (default {','.join(map(str, d.buckets))})")
    if "kv_len" in fields:
        p.add_argument("--kv-len", type=int, default=d.kv_len, help=f"KV cache length (default {d.kv_len})")
    if "sliding_cache" in fields:
        from harness.base.settings import SLIDING_CACHES

        p.add_argument("--sliding-cache", choices=list(SLIDING_CACHES), default=d.sliding_cache,
                       help=f"sliding layers' KV cache: linear (--kv-len slots) or ring (window slots) "
                            f"(default {d.sliding_cache}; docs/long-context.md)")
    if "quantize" in fields:
        from harness.base.settings import QUANTIZE_CHOICES

        p.add_argument("--quantize", choices=list(QUANTIZE_CHOICES), default=d.quantize,
                       help="weight storage: int8 stores the decoder's projections as int8 with per-output-channel "
                            "scales, dequantized before each matmul (NxD Inference's scheme; default: unquantized; "
                            "docs/quantization.md)")
    if "batch" in fields:
        p.add_argument("--batch", type=int, default=d.batch, metavar="N",
                       help=f"serve the prompts as a batch of N sequences, each in its own KV slot, with "
                            f"continuous batching; each is judged against its prompt alone (default: batch 1, and check "
                            "then adds a batch stage of its prompts; --batch 1: batch 1 only)")
    if "backend" in fields:
        p.add_argument("--compile-budget", type=budget_minutes, default=None, metavar="MINUTES",
                       help="refuse, before compiling, a neuron run whose cold compile (every graph of its builds, "
                            "`info --plan`) is planned over MINUTES, a finite number > 0; neuron only: cpu and xla "
                            "runs are not budgeted (harness/plan/compile_budget.py)")
    if "backend_options" in fields:
        p.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE", dest="backend_option",
                       help="an option of the backend, e.g. compile_workers=4 for neuron (repeatable; an option "
                            "the backend does not have is refused)")
    p.set_defaults(run_fields=tuple(fields), run_defaults=d)


def budget_minutes(text: str) -> float:
    """--compile-budget's value: a finite number of minutes over 0 (0 would refuse every cold compile,
    a warm cache's included, since the plan counts graphs, not the cache; say what you mean with a
    small positive budget instead)."""
    import math

    try:
        minutes = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes") from None
    if not math.isfinite(minutes) or minutes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of minutes over 0")
    return minutes


def run_settings(args):
    """The RunSettings of a command's arguments (what `add_run_args` added; the rest from its
    defaults). Backend options are checked against the backend's declared options here, in the
    validation pass: a misspelt option is refused (exit 2) before any model work."""
    from harness.backends import backend_options
    from harness.base.settings import parse_backend_options

    given = {name: getattr(args, name) for name in args.run_fields if name != "backend_options"}
    settings = args.run_defaults.but(**given)
    if "backend_options" in args.run_fields:
        raw = parse_backend_options(args.backend_option)
        settings = settings.but(backend_options=backend_options(settings.backend, raw))
    if getattr(args, "compile_budget", None) is not None and settings.backend != "neuron":
        from harness.base.errors import OptionError

        raise OptionError(f"--compile-budget {args.compile_budget:g}: only --backend neuron's cold compile is "
                          f"budgeted; the {settings.backend} backend compiles nothing against it: drop the option")
    return settings


def add_port_args(p, report_help: str, batch: bool = False) -> None:
    """How the port runs (the run settings; --batch where the prompts may run as a batch) and where
    results go (check, bisect)."""
    add_run_args(p, fields=RUN_ARGS + (("batch",) if batch else ()))
    p.add_argument("--json", metavar="FILE", help="write the result as JSON (replaces only a result "
                   "gemma-parity wrote)")
    p.add_argument("--report", metavar="DIR", help=report_help)


def with_generator(payload: dict, command: str, args=None) -> dict:
    """A JSON result marked as this tool's, so a later run may replace it (and nothing else); with
    the command's `args`, also its provenance (harness/base/provenance.py)."""
    import harness

    out = {"generator": f"gemma-parity {command} {harness.__version__}", **payload}
    if getattr(getattr(args, "settings", None), "demo_fault", None):  # a planted bug's result, marked as such
        from harness.port.demo_fault import banner

        out["demo_fault"] = {"name": args.settings.demo_fault, "note": banner(args.settings.demo_fault)}
    if args is not None:
        out["provenance"] = run_provenance(args)
    return out


PROVENANCE_FILES = ("golden", "prompts", "corpus")


def run_provenance(args) -> dict:
    """The command line's settings in full, the resolved run settings, and the inputs' hashes."""
    import dataclasses

    from harness.base.provenance import file_sha256, provenance

    plain = (str, int, float, bool, type(None), list, tuple)
    settings = {k: v for k, v in sorted(vars(args).items()) if isinstance(v, plain) and not k.endswith("_ids")
                and k not in ("func", "validate")}
    if dataclasses.is_dataclass(getattr(args, "settings", None)):
        values = {f.name: getattr(args.settings, f.name) for f in dataclasses.fields(args.settings)}
        settings["run"] = {k: (v if isinstance(v, plain) else {str(a): str(b) for a, b in v.items()}
                               if hasattr(v, "items") else str(v)) for k, v in values.items()}
    inputs = {}
    if getattr(args, "ckpt", None) is not None:
        inputs["checkpoint"] = args.ckpt.file_hashes()
    for name in PROVENANCE_FILES:
        value = getattr(args, name, None)
        if isinstance(value, str) and Path(value).is_file():
            inputs[name] = file_sha256(value)
        elif isinstance(value, str) and Path(value).is_dir():
            inputs[name] = {p.name: file_sha256(p) for p in sorted(Path(value).glob("*.json"))}
    return provenance(settings, inputs)
