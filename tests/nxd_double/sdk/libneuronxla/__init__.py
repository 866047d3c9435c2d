"""Double of libneuronxla 2.2.17544.0: `neuron_xla_compile`, the call through which ModelBuilder v2
runs neuronx-cc (neuronx-distributed Release 2.29, src/neuronx_distributed/trace/functions.py
compile(): keyword arguments module_bytes, compiler_flags, input_format, platform_target,
cache_key, retry_failed_compilation, lazy, use_cache, cache_dir, work_dir).

The flags are parsed the way neuronx-cc's command line parses them, against the option values of
the Neuron Compiler CLI reference (neuronx-cc `compile`: --target <instance_family>, --model-type,
--auto-cast, --auto-cast-type, --optlevel/-O, --logical-nc-config/-lnc (NxD and NxD-Inference
pass --lnc=N), the --enable-* switches, --logfile, --verbose). An unknown option or value fails
the compile, as the real compiler's argument parser does. Nothing is compiled: the returned "NEFF"
records the flags; execution is eager (tests/nxd_double/sdk/neuronx_distributed/trace).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

TARGETS = ("inf2", "trn1", "trn1n", "trn2", "trn3")
LNC_BY_TARGET = {"inf2": (1,), "trn1": (1,), "trn1n": (1,), "trn2": (1, 2), "trn3": (1, 2)}
SWITCHES = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation", "--enable-fast-context-switch",
            "--enable-fast-loading-neuron-binaries", "--enable-internal-neff-wrapper",
            "--disable-mixed-precision-accumulation")


class CompilerError(RuntimeError):
    """neuronx-cc refused its command line (exit status 2 from its argument parser)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuronx-cc compile", add_help=False, exit_on_error=False,
                                allow_abbrev=False)
    p.add_argument("--target", choices=TARGETS)
    p.add_argument("--model-type", choices=("generic", "transformer", "unet-inference"))
    p.add_argument("--auto-cast", choices=("none", "matmult", "all"))
    p.add_argument("--auto-cast-type", choices=("bf16", "fp16", "tf32", "fp8_e4m3"))
    p.add_argument("-O", "--optlevel", choices=("1", "2", "3"))
    p.add_argument("--logical-nc-config", "-lnc", "--lnc", type=int, choices=(1, 2))
    p.add_argument("--logfile")
    p.add_argument("--verbose")
    p.add_argument("--output")
    for switch in SWITCHES:
        p.add_argument(switch, action="store_true")
    return p


def parse_flags(compiler_flags) -> argparse.Namespace:
    words = compiler_flags.split() if isinstance(compiler_flags, str) else list(compiler_flags)
    internal = [w for w in words if w.startswith("--internal-") and w != "--internal-neff-wrapper"]
    words = [w for w in words if w not in internal]
    try:
        args, unknown = _parser().parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise CompilerError(f"neuronx-cc: error: {exc}") from None
    if unknown:
        raise CompilerError(f"neuronx-cc: error: unrecognized arguments: {' '.join(unknown)}")
    return args


def neuron_xla_compile(module_bytes, compiler_flags, input_format="hlo", platform_target=None, cache_key=None,
                       retry_failed_compilation=False, lazy=False, use_cache=True, cache_dir=None, work_dir=None):
    if input_format != "hlo":
        raise CompilerError(f"input format {input_format!r}: the double models HLO input only")
    args = parse_flags(compiler_flags)
    if platform_target not in TARGETS:
        raise CompilerError(f"platform target {platform_target!r} is not one of {TARGETS}")
    if args.target is not None and args.target != platform_target:
        raise CompilerError(f"--target {args.target} contradicts the platform target {platform_target}")
    lnc = args.logical_nc_config or 1
    if lnc not in LNC_BY_TARGET[platform_target]:
        raise CompilerError(f"--lnc {lnc} is not supported on {platform_target}")
    record = {"flags": compiler_flags, "target": platform_target, "module": hashlib.sha256(module_bytes).hexdigest()}
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        log = args.logfile or os.path.join(work_dir, "log-neuron-cc.txt")
        Path(log).write_text(f"nxd double: compiled for {platform_target} with {compiler_flags}\n")
    return json.dumps(record).encode()
