"""`gemma-parity doctor`: the inf2 host's preflight, before any compile.

Each check prints one line: `ok` with what it found, or `FAIL` with the problem and the fix. The
checks: the Python version the Neuron SDK wheels support; the pinned Neuron packages (none missing,
no PyPI placeholder, no known-broken release; off-pin versions only warn); importing torch_neuronx,
neuronx_distributed (the backend's way, harness/backends/neuron_env.py) and libneuronxla; `neuron-ls`
and the NeuronCores it lists; `neuronx-cc --version` against the pin; the NeuronCores this run may
use (NEURON_RT_VISIBLE_CORES) against the TP degree; whether the model's weights plus its KV
cache fit the HBM of those cores; NeuronCores another process holds, free disk for the compile work
directory, host memory, and the device plan (doctor_host.py). Nothing is traced or compiled: it takes seconds (the imports are
the slowest part). Exit 0 when every check passes, 2 otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import NamedTuple

from harness.cli import validate as v
from harness.base.settings import RunSettings
from harness.cli.common import EXIT_BAD_INPUT, EXIT_OK, add_run_args, dtype_arg, run_settings

SUPPORTED_PYTHON = ((3, 11), (3, 13))  # the Neuron SDK 2.31 wheels
TOOL_TIMEOUT_S = 30


class Check(NamedTuple):
    name: str
    ok: bool
    message: str  # what was found, or the problem and its fix
    warning: bool = False  # passes, but worth a look


def add_command(sub) -> None:
    p = sub.add_parser("doctor", help="preflight of an inf2 host: Neuron packages, imports, tools, cores, HBM fit",
                       description="Check this host can run the neuron backend, before any compile: the pinned "
                                   "Neuron SDK packages and their imports, neuron-ls, neuronx-cc, the visible "
                                   "NeuronCores against --tp, and the model's weights + KV cache against HBM. One "
                                   "line per check, each failure with its fix. Exit 0 all pass, 2 otherwise.")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory whose config.json sizes the HBM check")
    group.add_argument("--config", metavar="FILE", help="a config.json (default: the 12B's, "
                       "fixtures/configs/gemma-4-12b-it.json)")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree the run will use (default 2)")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length the run will compile (default 256)")
    p.add_argument("--dtype", type=dtype_arg, default="bfloat16", metavar="DTYPE",
                   help="device dtype, one the commands run: bfloat16 (bf16) or float32 (fp32) (default bfloat16)")
    # the HBM check counts the run's own build: its buckets, KV slots (batch buckets) and graphs
    add_run_args(p, RunSettings(backend="neuron"), fields=("buckets", "sliding_cache", "batch", "backend_options", "quantize"))
    p.add_argument("--speculate", type=int, default=0, metavar="K", help="draft length of speculative decoding: "
                   "the HBM check counts the verify graph (K+1 positions) at each KV bucket (default 0: none)")
    p.set_defaults(func=run, validate=validate)


def validate(args) -> None:
    from harness import FIXTURES_DIR
    from harness.base.settings import DTYPES
    from harness.inputs.spec import load_spec

    v._int_option(args, "tp", 1)
    v._int_option(args, "kv_len", 1)
    v._dtype(args, DTYPES)  # the run dtypes: a check of a dtype no command runs (fp16) would prove nothing
    if args.checkpoint is not None:
        source = v.input_path(args.checkpoint, "--checkpoint", want_dir=True)
    elif args.config is not None:
        source = v.input_path(args.config, "--config", want_dir=False)
    else:
        source = FIXTURES_DIR / "configs" / "gemma-4-12b-it.json"
    args.spec = load_spec(source)
    v.check_tp(args.spec, args.tp)
    v.check_kv_len(args.spec, args.kv_len)
    v._int_option(args, "batch", 1)
    v._int_option(args, "speculate", 0)
    settings = run_settings(args)
    args.build = build_of(settings.but(kv_len=args.kv_len, speculate=args.speculate))


def build_of(settings) -> dict:
    """The device fit's build keywords of a run (instances.core_bytes): what the HBM line counts."""
    from harness.plan.instances import layout_transform

    return dict(buckets=settings.buckets, sliding_cache=settings.sliding_cache, batch=settings.batch,
                speculate=settings.speculate, layout=layout_transform(settings.backend_options),
                quantize=settings.quantize)  # int8 weights on the core under --quantize


def run(args) -> int:
    checks = diagnose(args.spec, args.tp, args.dtype, args.kv_len, build=args.build)
    for check in checks:
        status = "ok  " if check.ok and not check.warning else "warn" if check.ok else "FAIL"
        print(f"{status} {check.name}: {check.message}")
    failed = [c for c in checks if not c.ok]
    print(f"doctor: {len(checks) - len(failed)} of {len(checks)} checks pass"
          + (f"; fix the {len(failed)} above before running the neuron backend" if failed else ""))
    return EXIT_BAD_INPUT if failed else EXIT_OK


def diagnose(spec, tp: int, dtype: str, kv_len: int, environ=None, build: dict | None = None) -> list[Check]:
    """Every check, in order; later ones that need a tool or package the earlier ones found missing
    are still run, so one pass lists every problem. `build`: the run's build (build_of) the HBM
    check counts."""
    environ = os.environ if environ is None else environ
    checks = [python_check(sys.version_info[:2])]
    versions, package_checks = packages_check()
    checks += package_checks
    checks += import_checks(versions)
    cores, ls_check = neuron_ls_check()
    checks.append(ls_check)
    checks.append(compiler_check())
    checks.append(cores_check(cores, tp, environ, fit=(spec, dtype, kv_len)))
    checks += host_checks(spec, tp, dtype, kv_len, build)
    return checks


def host_checks(spec, tp: int, dtype: str, kv_len: int, build: dict | None = None) -> list[Check]:
    """Cores other processes hold, disk for the compile work directory, host memory, the device plan
    (harness/cli/doctor_host.py)."""
    from harness.backends import neuron_env as env
    from harness.backends.neuron_cache import default_cache_dir
    from harness.cli import doctor_host as host
    from harness.port.sharding import bytes_per_rank

    listing, _ = _tool("neuron-ls", "--json-output")
    try:  # output that is not neuron-ls's is its line's FAIL (neuron_ls_check), not a crash here
        cores = env._cores_from_neuron_ls(listing) if listing else 0
        host.busy_cores(listing, os.getpid()) if listing else None
    except UNREADABLE_LISTING:
        listing, cores = None, 0
    weights = tp * bytes_per_rank(spec, tp, dtype, kv_len)["weights"]
    return [host.plan_check(spec, tp, dtype, kv_len, Check, **(build or {})),
            host.cores_in_use_check(listing, cores, tp, Check),
            host.disk_check(default_cache_dir() / ".work", Check),
            host.memory_check(host.read_meminfo(), weights, Check)]


# What parsing an output that is not neuron-ls's raises: not JSON or misshapen (ValueError, TypeError,
# AttributeError), a count of 1e999 (OverflowError), nesting deeper than the parser's stack (RecursionError).
UNREADABLE_LISTING = (ValueError, TypeError, AttributeError, OverflowError, RecursionError)


def neuron_ls_cores(listing: str | None) -> int:
    from harness.backends import neuron_env as env

    try:
        return env._cores_from_neuron_ls(listing) if listing else 0
    except UNREADABLE_LISTING:
        return 0


def python_check(version: tuple[int, int]) -> Check:
    low, high = SUPPORTED_PYTHON
    text = f"{version[0]}.{version[1]}"
    if low <= version <= high:
        return Check("python", True, text)
    return Check("python", False, f"Python {text}, but the Neuron SDK wheels need {low[0]}.{low[1]}-{high[0]}."
                 f"{high[1]}; fix: python3.12 -m venv .venv && . .venv/bin/activate, then install again")


def packages_check() -> tuple[dict[str, str], list[Check]]:
    from harness.backends import neuron_packages as env

    versions, texts = env.installed_neuron_packages()
    problems, placeholders = env.package_problems(versions, texts)
    checks = [Check("packages", False, f"{p}; fix: {env.install_fix(placeholders)}") for p in problems]
    if not problems:
        off = env.off_pin(versions)
        found = ", ".join(f"{n} {versions[n]}" for n in env.PINNED_VERSIONS)
        checks.append(Check("packages", True, found + (f" (off the Neuron SDK {env.NEURON_SDK_RELEASE} pins: "
                                                      f"{', '.join(off)}; fix: {env.INSTALL_COMMAND})" if off else ""),
                            warning=bool(off)))
    usable = {n: ver for n, ver in versions.items() if not any(p.startswith(f"{n} ") for p in problems)}
    return usable, checks


IMPORTS = (("torch-neuronx", "torch_neuronx"), ("neuronx-distributed", "neuronx_distributed"),
           ("libneuronxla", "libneuronxla"))


def import_checks(usable: dict[str, str]) -> list[Check]:
    """Import each installed, usable SDK package (neuronx_distributed the backend's way)."""
    from harness.backends import neuron_env as env
    from harness.backends.neuron_packages import INSTALL_COMMAND

    checks = []
    for dist, module in IMPORTS:
        if dist not in usable:
            continue  # the packages check already said what to do
        try:
            env.import_sdk(module)
        except Exception as exc:  # noqa: BLE001  (any import failure is this check's finding)
            checks.append(Check(f"import {module}", False, f"{type(exc).__name__}: {exc}; fix: reinstall the "
                                f"Neuron SDK packages ({INSTALL_COMMAND}) in a fresh venv"))
        else:
            checks.append(Check(f"import {module}", True, "imports"))
    return checks


def _tool(name: str, *args: str) -> tuple[str | None, str]:
    """(stdout, problem) of running a Neuron tool; stdout None when it is absent or fails."""
    exe = shutil.which(name) or (f"/opt/aws/neuron/bin/{name}" if os.access(f"/opt/aws/neuron/bin/{name}", os.X_OK)
                                 else None)
    if exe is None:
        return None, f"{name} not found on PATH or in /opt/aws/neuron/bin"
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=True)
    except subprocess.TimeoutExpired:
        return None, f"`{name} {' '.join(args)}` did not answer in {TOOL_TIMEOUT_S} s"
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        return None, f"`{name} {' '.join(args)}` failed: {detail.strip()[:200]}"
    return out.stdout, ""


def neuron_ls_check() -> tuple[int, Check]:
    from harness.backends import neuron_env as env

    out, problem = _tool("neuron-ls", "--json-output")
    if out is None:
        return 0, Check("neuron-ls", False, f"{problem}; fix: on an inf2 host with the Neuron driver, install "
                        "aws-neuronx-tools and put /opt/aws/neuron/bin on PATH")
    try:
        cores = env._cores_from_neuron_ls(out)
    except UNREADABLE_LISTING as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:160]
        return 0, Check("neuron-ls", False, f"unreadable --json-output ({why}); fix: update aws-neuronx-tools")
    if cores == 0:
        return 0, Check("neuron-ls", False, "lists no NeuronCore; fix: run on an inf2 instance with the Neuron "
                        "driver loaded (aws-neuronx-dkms)")
    return cores, Check("neuron-ls", True, f"{cores} NeuronCores")


def compiler_check() -> Check:
    from harness.backends import neuron_packages as env

    out, problem = _tool("neuronx-cc", "--version")
    pin = env.PINNED_VERSIONS["neuronx-cc"]
    if out is None:
        return Check("neuronx-cc", False, f"{problem}; fix: {env.INSTALL_COMMAND} (neuronx-cc=={pin})")
    match = re.search(r"\d+\.\d+\.\d+(?:\.\d+)?", out)
    if match is None:
        return Check("neuronx-cc", False, f"`neuronx-cc --version` printed no version ({out.strip()[:80]!r}); "
                     f"fix: {env.INSTALL_COMMAND}")
    version = match.group(0)
    if (why := env._broken_reason("neuronx-cc", version)) is not None:
        return Check("neuronx-cc", False, f"{version} {why}; fix: {env.INSTALL_COMMAND} (neuronx-cc=={pin})")
    if not env.version_matches(version, pin):
        return Check("neuronx-cc", True, f"{version} (pinned {pin}; fix: {env.INSTALL_COMMAND})", warning=True)
    return Check("neuronx-cc", True, version)


def cores_check(total: int, tp: int, environ, fit=None) -> Check:
    """The NeuronCores this run may use against --tp; with `fit` (spec, dtype, KV length) a host with
    too few cores is told the smallest TP that fits the model, never a --tp it cannot fit."""
    from harness.backends import neuron_env as env
    from harness.base.errors import HarnessInputError

    visible = environ.get("NEURON_RT_VISIBLE_CORES")
    if visible:
        try:
            env.check_visible_cores(visible, tp)
        except HarnessInputError as exc:
            return Check("cores", False, str(exc))
        return Check("cores", True, f"NEURON_RT_VISIBLE_CORES={visible} gives tp={tp} its cores")
    if total < tp:
        return Check("cores", False, f"tp={tp} needs {tp} NeuronCores but this host has {total}; fix: run on an "
                     f"instance with at least {tp} (inf2.8xlarge has 2){_smaller_tp_hint(total, fit)}")
    return Check("cores", True, f"{total} NeuronCores for tp={tp}")


def _smaller_tp_hint(total: int, fit) -> str:
    """What a smaller --tp can do for this model: the smallest TP that fits, if this host has its cores."""
    if fit is None:
        return "; a smaller --tp helps only if the model fits it (`gemma-parity info --tp N` shows the fit)"
    from harness.plan.instances import smallest_fitting_tp

    spec, dtype, kv_len = fit
    smallest = smallest_fitting_tp(spec, dtype, kv_len)
    if smallest is None:
        return "; no TP degree up to 24 fits this model at this --kv-len"
    if smallest <= total:
        return f", or --tp {smallest}, the smallest TP that fits this model (`gemma-parity info --tp {smallest}`)"
    return (f"; no --tp within this host's {total} NeuronCore(s) fits this model: the smallest that fits is "
            f"tp={smallest} (`gemma-parity info` shows the plan)")
