"""What every command shares: exit codes, the model arguments, the bucket-list parser."""

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


def add_model_args(p, config: bool = False) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", metavar="DIR", help="local checkpoint directory (config.json + *.safetensors)")
    if config:
        group.add_argument("--config", metavar="FILE", help="a config.json (no weights needed)")
    group.add_argument("--model", choices=["tiny"], help="the embedded tiny 12B-shaped model (built and cached on first use)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model (default 0)")


def checkpoint_dir(args) -> Path:
    from harness.checkpoint import tiny_checkpoint

    if getattr(args, "checkpoint", None):
        return Path(args.checkpoint)
    return tiny_checkpoint(seed=args.seed)


def buckets_arg(text: str) -> tuple[int, ...]:
    try:
        buckets = tuple(sorted({int(b) for b in text.split(",") if b.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--buckets {text!r}: expected comma-separated integers like 16,64")
    if not buckets or min(buckets) < 1:
        raise argparse.ArgumentTypeError(f"--buckets {text!r}: need at least one positive bucket")
    return buckets


def add_port_args(p, report_help: str) -> None:
    """How the port runs (backend, TP, dtype, buckets, KV length) and where results go."""
    from harness.backends import BACKENDS

    p.add_argument("--backend", choices=list(BACKENDS), default="cpu")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="port dtype: bfloat16 (default) or float32")
    p.add_argument("--buckets", type=buckets_arg, default=(64, 256),
                   help="prefill buckets, e.g. 16,64 (default 64,256: the default prompts reach position 247)")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length (default 256)")
    p.add_argument("--sliding-cache", choices=["linear", "ring"], default="linear",
                   help="sliding layers' cache: linear (kv-len slots, default) or ring (window slots); README, 'KV cache'")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON (replaces only a result "
                   "gemma-parity wrote)")
    p.add_argument("--report", metavar="DIR", help=report_help)


def with_generator(payload: dict, command: str) -> dict:
    """A JSON result marked as this tool's, so a later run may replace it (and nothing else)."""
    import harness

    return {"generator": f"gemma-parity {command} {harness.__version__}", **payload}
