"""The Neuron host's environment, read without importing the Neuron SDK (the SDK's package
versions are harness/backends/neuron_packages.py): the NeuronCores this host has and
which of them this process may use, the platform the build targets, the Neuron runtime's version,
and the one way the backend imports neuronx-distributed (`import_neuronx_distributed`, which works
whether or not NxD's import chain finds `transformers.utils.fx`).

`harness/backends/neuron.py` (the backend) and `gemma-parity doctor` (the device preflight) both
use these; nothing here touches a device or compiles anything.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types

from harness.base.errors import HarnessInputError

# ==== NeuronCores and pytest-xdist workers =========================================================

INF2_CORES_PER_DEVICE = 2  # one Inferentia2 chip (/dev/neuronN) has two NeuronCores
INF2_LNC = 1  # logical NeuronCore size on inf2 (NeuronCore-v2: no LNC=2)
MAX_CORE_ID = 1023  # far above the largest instance (trn2.48xlarge: 128 cores); a bigger id is a typo

def _cores_from_neuron_ls(text: str) -> int:
    """Sum of nc_count over the devices `neuron-ls --json-output` lists."""
    count = sum(int(device.get("nc_count", 0)) for device in json.loads(text))
    if not 0 <= count <= MAX_CORE_ID:
        raise ValueError(f"nc_count total {count} is not a NeuronCore count")
    return count


def _device_files() -> list[str]:
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def neuron_core_count() -> int:
    """NeuronCores on this host: `neuron-ls --json-output` when it runs, else /dev/neuron* devices
    times two cores each (inf2). 0 on a machine without the Neuron driver."""
    exe = shutil.which("neuron-ls")
    if exe:
        try:
            out = subprocess.run([exe, "--json-output"], capture_output=True, text=True, timeout=60,
                                 check=True)
            return _cores_from_neuron_ls(out.stdout)
        except (OSError, subprocess.SubprocessError, ValueError, TypeError, AttributeError, OverflowError,
                RecursionError):  # output that is not neuron-ls's (deep nesting, nc_count 1e999)
            pass  # fall back to counting device files
    return INF2_CORES_PER_DEVICE * len(_device_files())


def _format_cores(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def visible_cores_for_worker(worker_id: str | None, cores_per_worker: int, total_cores: int) -> str:
    """NEURON_RT_VISIBLE_CORES for one pytest-xdist worker: gw<N> gets cores
    [N * cores_per_worker, (N + 1) * cores_per_worker); no worker (None or "master") starts at 0."""
    if not isinstance(cores_per_worker, int) or cores_per_worker < 1:
        raise HarnessInputError(f"cores per worker must be a positive integer, got {cores_per_worker!r}")
    if worker_id in (None, "", "master"):
        index = 0
    else:
        match = re.fullmatch(r"gw(\d+)", worker_id)
        if not match:
            raise HarnessInputError(f"unrecognised pytest-xdist worker id {worker_id!r} (expected gw0, gw1, ...)")
        index = int(match.group(1))
    first = index * cores_per_worker
    if first + cores_per_worker > total_cores:
        who = f"pytest-xdist worker {worker_id}" if index else "this run"
        raise HarnessInputError(
            f"{who} needs NeuronCores {_format_cores(first, cores_per_worker)} "
            f"({cores_per_worker} per worker for tp={cores_per_worker}) but this host has {total_cores}. "
            f"Run at most {total_cores // cores_per_worker} worker(s) on Neuron tests "
            f"(pytest -m neuron -n {max(total_cores // cores_per_worker, 1)}), or without -n."
        )
    return _format_cores(first, cores_per_worker)


def parse_visible_cores(value: str) -> list[int]:
    """The NeuronCore ids a NEURON_RT_VISIBLE_CORES value names: '0-1', '2', '0,1', '0-3,6'."""
    cores: list[int] = []
    for part in value.replace(" ", "").split(","):
        match = re.fullmatch(r"([0-9]{1,6})(?:-([0-9]{1,6}))?", part)  # ASCII digits only (not \d: ٠-١)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise HarnessInputError(f"NEURON_RT_VISIBLE_CORES={value!r}: {part!r} is not a core id or a range "
                                    "like 0-1 (ASCII digits); write e.g. NEURON_RT_VISIBLE_CORES=0-1")
        if int(match.group(2) or match.group(1)) > MAX_CORE_ID:
            raise HarnessInputError(f"NEURON_RT_VISIBLE_CORES={value!r}: core {int(match.group(2) or match.group(1))} "
                                    f"is beyond any Neuron host (ids 0-{MAX_CORE_ID}); write e.g. "
                                    "NEURON_RT_VISIBLE_CORES=0-1")
        first = int(match.group(1))
        cores.extend(range(first, int(match.group(2) or first) + 1))
    return sorted(set(cores))


def check_visible_cores(value: str, tp: int) -> None:
    """Refuse a NEURON_RT_VISIBLE_CORES that names fewer NeuronCores than the TP degree: the
    runtime would fail only when it loads the graphs, after the whole compile."""
    cores = parse_visible_cores(value)
    if len(cores) < tp:
        raise HarnessInputError(
            f"NEURON_RT_VISIBLE_CORES={value!r} names {len(cores)} NeuronCore(s) but tp={tp} needs {tp}: "
            f"set it to {tp} cores (e.g. NEURON_RT_VISIBLE_CORES={_format_cores(cores[0] if cores else 0, tp)}), "
            "or unset it to let the harness choose")


def assign_visible_cores(cores_per_worker: int, environ=None, total_cores: int | None = None) -> str:
    """Set NEURON_RT_VISIBLE_CORES for this process from PYTEST_XDIST_WORKER, before the Neuron
    runtime starts. Outside xdist a value the user already set is kept, if it names enough cores."""
    environ = os.environ if environ is None else environ
    worker = environ.get("PYTEST_XDIST_WORKER")
    if worker is None and environ.get("NEURON_RT_VISIBLE_CORES"):
        check_visible_cores(environ["NEURON_RT_VISIBLE_CORES"], cores_per_worker)
        return environ["NEURON_RT_VISIBLE_CORES"]
    total = neuron_core_count() if total_cores is None else total_cores
    if total == 0:
        raise HarnessInputError("no NeuronCore on this host (neuron-ls found none and there are no "
                                "/dev/neuron* devices): the neuron backend runs on inf2 with the "
                                "Neuron driver; on a CPU machine use --backend cpu")
    cores = visible_cores_for_worker(worker, cores_per_worker, total)
    environ["NEURON_RT_VISIBLE_CORES"] = cores
    return cores


# ==== the build's platform ========================================================================

# neuronx-distributed asks torch-neuronx for the platform (`get_platform_target()`, no argument) in
# places the compiler flags never reach: `parallel_state.initialize_model_parallel` on every call,
# and the weight-layout transformer's compile (its flags carry no --target). On a host without a
# Neuron device that question fails unless this variable names the platform (NxD's and NxD-Inference's
# own tests set it the same way).
PLATFORM_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"


def target_of(flags: list[str]) -> str | None:
    """The platform `--target <family>` names in a list of compiler words, else None."""
    return flags[flags.index("--target") + 1] if "--target" in flags[:-1] else None


@contextlib.contextmanager
def build_platform(flags: list[str], environ=None):
    """Name the compile's target platform to NxD's platform queries for the duration of a build:
    sets NEURON_PLATFORM_TARGET_OVERRIDE to the flags' `--target` when it is unset, and refuses a
    value that contradicts it."""
    environ = os.environ if environ is None else environ
    target, current = target_of(flags), environ.get(PLATFORM_ENV)
    if target is None or current == target:
        yield target or current
        return
    if current:
        raise HarnessInputError(f"{PLATFORM_ENV}={current} contradicts the compiler flags' --target {target}: "
                                f"unset {PLATFORM_ENV} or build for {current}")
    environ[PLATFORM_ENV] = target
    try:
        yield target
    finally:
        environ.pop(PLATFORM_ENV, None)


# ==== the Neuron runtime ===========================================================================

RUNTIME_PACKAGE = "aws-neuronx-runtime-lib"  # the Neuron runtime (libnrt), a system package


def neuron_runtime_version() -> str:
    """The installed Neuron runtime's version (dpkg, else rpm), or 'unknown'."""
    for command in (["dpkg-query", "-W", "-f=${Version}", RUNTIME_PACKAGE],
                    ["rpm", "-q", "--qf", "%{VERSION}-%{RELEASE}", RUNTIME_PACKAGE]):
        if shutil.which(command[0]) is None:
            continue
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.stdout.strip():
            return out.stdout.strip()
    return "unknown"


# ==== importing neuronx-distributed ================================================================

# neuronx-distributed's package __init__ imports its `pipeline` package, whose trace module does
# `from transformers.utils.fx import HFTracer` whenever transformers imports (aws-neuron/
# neuronx-distributed, src/neuronx_distributed/pipeline/trace.py, Release 2.29). transformers 5
# removed `transformers.utils.fx`, and this project needs transformers 5 (Gemma-4) in the same
# environment, so `import neuronx_distributed` fails there. HFTracer serves only NxD's pipeline-
# parallel FX tracing of transformers models, which the port never uses: while NxD imports, a stand-in
# module takes the missing one's place, and it is removed again as soon as the import is done.
FX_MODULE = "transformers.utils.fx"


class _MissingHFTracer:
    """Stand-in for transformers 4's HFTracer: defining subclasses works, using one does not."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "transformers.utils.fx.HFTracer does not exist in this transformers (5.x); gemma-parity "
            "installed a stand-in only so that neuronx_distributed imports. NxD's pipeline-parallel "
            "tracing of transformers models is not available in this environment.")


def _fx_stand_in() -> types.ModuleType | None:
    """A stand-in module when transformers imports but has no transformers.utils.fx; else None."""
    if importlib.util.find_spec("transformers") is None:
        return None  # NxD skips the HFTracer import without transformers
    try:
        importlib.import_module(FX_MODULE)
        return None  # transformers 4.x: the real module is used
    except ModuleNotFoundError as exc:
        if exc.name != FX_MODULE:
            return None  # something else is missing: let NxD's import report it
    module = types.ModuleType(FX_MODULE, "gemma-parity stand-in: transformers 5 has no transformers.utils.fx")
    module.HFTracer = _MissingHFTracer
    return module


def import_sdk(module: str) -> types.ModuleType:
    """Import one Neuron SDK module by name (neuronx_distributed the compatible way): the preflight's
    import checks, kept here so that only the backend's modules import the SDK."""
    if module == "neuronx_distributed":
        return import_neuronx_distributed()
    return importlib.import_module(module)


def import_neuronx_distributed() -> types.ModuleType:
    """`import neuronx_distributed`, whatever transformers this environment has (see FX_MODULE)."""
    if sys.modules.get("neuronx_distributed") is not None:
        return sys.modules["neuronx_distributed"]
    stand_in = _fx_stand_in()
    if stand_in is not None:
        sys.modules[FX_MODULE] = stand_in
    try:
        return importlib.import_module("neuronx_distributed")
    finally:
        if stand_in is not None and sys.modules.get(FX_MODULE) is stand_in:
            del sys.modules[FX_MODULE]
