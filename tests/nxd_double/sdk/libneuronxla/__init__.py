"""Double of libneuronxla 2.2.17544.0: `neuron_xla_compile`, the call through which ModelBuilder v2
runs neuronx-cc (neuronx-distributed Release 2.29, src/neuronx_distributed/trace/functions.py
compile(): keyword arguments module_bytes, compiler_flags, input_format, platform_target,
cache_key, retry_failed_compilation, lazy, use_cache, cache_dir, work_dir).

The flag string is split shell-style (NxD itself passes quoted values in one string: the layout
transformer's --internal-hlo2tensorizer-options='--a --b', NxD-Inference Gemma3's
--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2') and parsed the
way neuronx-cc's command line parses it, against the option values of the Neuron Compiler CLI
reference (neuronx-cc `compile`: --target <instance_family>, --model-type, --auto-cast,
--auto-cast-type, --optlevel/-O, --logical-nc-config/-lnc (NxD and NxD-Inference pass --lnc=N), the
--enable-* switches, --logfile, --verbose) plus the options NxD and NxD-Inference's models pass
(--tensorizer-options with its own option words, --internal-enable-dge-levels,
--internal-hlo2tensorizer-options, --internal-backend-options, --internal-max-instruction-limit,
--hbm-scratchpad-page-size). An unknown option or value fails the compile, as the real compiler's
argument parser does; so does an unknown word inside --tensorizer-options. Nothing is compiled: the returned "NEFF"
records the flags; execution is eager (tests/nxd_double/sdk/neuronx_distributed/trace).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
from pathlib import Path

TARGETS = ("inf2", "trn1", "trn1n", "trn2", "trn3")
LNC_BY_TARGET = {"inf2": (1,), "trn1": (1,), "trn1n": (1,), "trn2": (1, 2), "trn3": (1, 2)}
DGE_LEVELS = ("vector_dynamic_offsets", "spill_reload")  # the values NxD-Inference passes
SWITCHES = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation", "--enable-fast-context-switch",
            "--enable-fast-loading-neuron-binaries", "--enable-internal-neff-wrapper",
            "--disable-mixed-precision-accumulation")


class CompilerError(RuntimeError):
    """neuronx-cc refused its command line (exit status 2 from its argument parser)."""


# Every compile this process ran (the double's ledger, for tests): flags, target, module hash. A
# job's compile budget is modelled by $NXD_DOUBLE_COMPILE_BUDGET (graphs): the compile past it fails
# as the job would, killed at its timeout with that compile unfinished.
COMPILED: list[dict] = []


def _spend_budget(record: dict) -> None:
    budget = os.environ.get("NXD_DOUBLE_COMPILE_BUDGET")
    graphs = sum(1 for r in COMPILED if r["kind"] == "graph")
    if budget is not None and record["kind"] == "graph" and graphs >= int(budget):
        raise CompilerError(f"the job's compile budget of {budget} graphs is spent ({graphs} compiled): a real "
                            "job is killed at its timeout here, its later steps never run")
    COMPILED.append(record)


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
    p.add_argument("--tensorizer-options")
    p.add_argument("--internal-enable-dge-levels", nargs="+", choices=DGE_LEVELS)
    p.add_argument("--internal-hlo2tensorizer-options")
    p.add_argument("--internal-backend-options")
    p.add_argument("--internal-max-instruction-limit", type=int)
    p.add_argument("--hbm-scratchpad-page-size", type=int)
    for switch in SWITCHES:
        p.add_argument(switch, action="store_true")
    return p


def _tensorizer_parser() -> argparse.ArgumentParser:
    """The words NxD-Inference's models pass inside --tensorizer-options='...'."""
    p = argparse.ArgumentParser(prog="tensorizer", add_help=False, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--enable-ccop-compute-overlap", action="store_true")
    p.add_argument("--cc-pipeline-tiling-factor", type=int, choices=(1, 2, 4, 8))
    p.add_argument("--vectorize-strided-dma", action="store_true")
    p.add_argument("--skip-pass")
    return p


def _parse(parser, words):
    try:
        args, unknown = parser.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise CompilerError(f"neuronx-cc: error: {exc}") from None
    if unknown:
        raise CompilerError(f"neuronx-cc: error: unrecognized arguments: {' '.join(unknown)}")
    return args


def parse_flags(compiler_flags) -> argparse.Namespace:
    try:
        words = shlex.split(compiler_flags) if isinstance(compiler_flags, str) else list(compiler_flags)
    except ValueError as exc:
        raise CompilerError(f"neuronx-cc: error: {exc}") from None
    args = _parse(_parser(), words)
    if args.tensorizer_options is not None:
        _parse(_tensorizer_parser(), shlex.split(args.tensorizer_options))
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
    # the layout transformer (no --target, --lnc given) is not one of the build's graphs
    _spend_budget({**record, "kind": "layout" if "--enable-internal-neff-wrapper" not in compiler_flags
                   and "--lnc=1" in compiler_flags and args.target is None else "graph"})
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        log = args.logfile or os.path.join(work_dir, "log-neuron-cc.txt")
        Path(log).write_text(f"nxd double: compiled for {platform_target} with {compiler_flags}\n")
    return json.dumps(record).encode()
