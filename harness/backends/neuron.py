"""Neuron backend: NxD trace/compile/load/run of the per-rank decoder on inf2 (TP=2).

The only module of the project that imports torch_neuronx / neuronx_distributed, and it does so
inside functions: `import harness.backends.neuron` works on any CPU machine, and the pure parts
(version guard, artifact cache key, core assignment, weight assembly) are tested there.

What runs on the device is `harness.graphs.TracedDecoder` (the graphs, defined once for this and
the XLA backend) over `harness.model.RankDecoder`, the same code the CPU backend runs, built
with `NeuronLinears` (NxD's ColumnParallelLinear / RowParallelLinear instead of nn.Linear plus
explicit collectives) and traced with ModelBuilder v2 under NxDParallelState: one prefill graph per
bucket and one decode graph (s=1). The KV cache buffers, reassigned in forward, become device state
aliased between calls. Per-rank weights come from `harness.sharding.rank_state_dicts` and are
loaded with NxDModel.set_weights + to_neuron. Compiled graphs are cached on disk under a key of
everything that changes them (docs/design.md#backends); weights are never part of a cache entry.

NxD APIs used (signatures read in aws-neuron/neuronx-distributed's public source, Release 2.29
(commit fbac349, the newest published; 0.19 / SDK 2.31 has no public source):
ModelBuilder(model).trace(args=, tag=).compile(priority_model_key=, compiler_workdir=,
compiler_args=, max_workers=) -> NxDModel; NxDModel.set_weights(list of rank dicts), .to_neuron(),
.save(path), NxDModel.load(path), .get_metaneff(tag), .write_to_neuron_buffer(tensor, key, rank),
.read_from_neuron_buffer(key, rank) (keys: the raw checkpoint key) and forward(*args,
model_name=tag); NxDParallelState(world_size=, tensor_model_parallel_size=, lnc_size=);
parallel_layers.layers.ColumnParallelLinear / RowParallelLinear. tests/nxd_double is a contract
double of exactly this surface: tests/parity/test_neuron_double.py runs this backend through it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

from harness.atomic import atomic_directory
from harness.errors import HarnessInputError
from harness.graphs import (  # noqa: F401  (the device graphs, defined once for every backend)
    DECODE_TAG, POSITION_DTYPE, PREFILL_TAG, GraphBuildError, TracedDecoder, constant_buffers, example_inputs,
    graph_inputs, graph_plan, graph_result, kv_buffer_names, tag_for_length, unpack_outputs)
from harness.model import RankLinears
from harness.settings import DEFAULT_KV_LEN, RunSettings, directory, flag, positive_int
from harness.sharding import plan_model, rank_state_dicts

# ---- versions (docs/design.md#backends): keep in step with pyproject's `neuron` extra ------------

NEURON_SDK_RELEASE = "2.31"
PINNED_VERSIONS = {
    "torch-neuronx": "2.9.0.2.15.32035",
    "neuronx-distributed": "0.19.28492",
    "neuronx-cc": "2.26.6360.*",
    # The compile runs through libneuronxla.neuron_xla_compile. SDK 2.31 ships two: 3.x is the JAX
    # line (its 2.31 release notes: JAX 0.7-0.10 "must have libneuronxla version 3.*"); the 2.2 line
    # is the PyTorch/XLA one that torch-neuronx 2.9 pairs with.
    "libneuronxla": "2.2.17544.0",
}
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"  # the Neuron SDK's documented pip repository
INSTALL_COMMAND = f"pip install --extra-index-url={NEURON_PIP_INDEX} '.[neuron]'"
# PyPI carries empty packages of the same names (downloaded: torch-neuronx 1.0, neuronx-distributed
# 0.1, neuronx-cc 1.0.post1, libneuronxla 1.0); "WRONG PACKAGE" is in their description body, not in
# Summary (absent, or "UNKNOWN" for neuronx-cc).
PLACEHOLDER_VERSIONS = {"torch-neuronx": "1.0", "neuronx-distributed": "0.1", "neuronx-cc": "1.0",
                        "libneuronxla": "1.0"}
PLACEHOLDER_SUMMARY = "WRONG PACKAGE"
# Releases known to break this port, and why.
BROKEN_VERSIONS = {
    "neuronx-cc": {
        "2.27.5334": "crashes with NCC_ISMP902 (exit 70) compiling the token-generation graph of "
                     "sliding-window models on inf2 (aws-neuron-sdk issue 1391)",
    },
}

# ---- compile settings ---------------------------------------------------------------------------

# ModelBuilder.compile passes these to neuronx-cc as given. It adds --auto-cast=none and -O1 only
# when absent, plus --verbose=35 and --logfile=<workdir>/log-neuron-cc.txt; it never adds a target.
# Its own no-argument default starts with --enable-saturate-infinity, which passing flags replaces,
# so it is listed here (NxD-Inference's models pass it too; NeuronCore-v2, inf2's core, needs it to
# saturate +-inf instead of producing NaN). torch-neuronx reads the platform from the flag string
# split on whitespace: only `--target inf2` (two words) is seen; `--target=inf2` is not, and the
# target then comes from the host (which fails on a build host without a Neuron device).
DEFAULT_COMPILER_ARGS = ("--enable-saturate-infinity", "--model-type=transformer", "--auto-cast=none", "-O1",
                         "--target", "inf2")

# ---- the compiled-artifact cache ----------------------------------------------------------------

CACHE_FORMAT = 2  # bump when the layout of a cache entry changes (2: weight_shapes, last-row perf graphs)
MODEL_FILE = "nxd_model.pt"
META_FILE = "artifact.json"
CONSTANTS_FILE = "constants.safetensors"
ENTRY_FILES = (MODEL_FILE, META_FILE, CONSTANTS_FILE)
_HARNESS_DIR = Path(__file__).resolve().parent.parent
# The source the compiled graph is made from. sharding.py decides every per-rank shape; graphs.py
# defines the traced module and its inputs; this file builds its NxD linears, so it changes the graph too.
MODEL_SOURCE_FILES = (
    _HARNESS_DIR / "model.py",
    _HARNESS_DIR / "sharding.py",
    _HARNESS_DIR / "graphs.py",
    _HARNESS_DIR / "backends" / "neuron.py",
)

INF2_CORES_PER_DEVICE = 2  # one Inferentia2 chip (/dev/neuronN) has two NeuronCores
INF2_LNC = 1  # logical NeuronCore size on inf2 (NeuronCore-v2: no LNC=2)


# Tracing or compiling a graph failed (not bad input: the compiler or the model code); one error
# type whatever lowers the graph (harness/graphs.py).
NeuronBuildError = GraphBuildError


# ==== version guard ================================================================================

def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string, trailing zeros dropped: '1.0' -> (1,)."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if not match:
        return ()
    parts = [int(p) for p in match.group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def version_matches(version: str, pin: str) -> bool:
    """'2.26.6360.0+abc' matches '2.26.6360.*'; '0.19.28492' matches '0.19.28492' (and '.0')."""
    if pin.endswith(".*"):
        prefix = [int(p) for p in pin[:-2].split(".")]
        match = re.match(r"\d+(?:\.\d+)*", version.strip())
        found = [int(p) for p in match.group(0).split(".")] if match else []
        return found[:len(prefix)] == prefix
    return _release(version) == _release(pin)


def installed_neuron_packages() -> tuple[dict[str, str], dict[str, str]]:
    """(versions, metadata texts) of the pinned Neuron packages that are installed; the text is the
    Summary and the description body, where the PyPI placeholders say what they are."""
    versions, texts = {}, {}
    for name in PINNED_VERSIONS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        versions[name] = dist.version
        meta = dist.metadata
        body = meta.get_payload() if hasattr(meta, "get_payload") else ""
        texts[name] = "\n".join(t for t in (meta.get("Summary"), meta.get("Description"), body) if t)
    return versions, texts


def _is_placeholder(name: str, version: str, text: str | None) -> bool:
    if text and PLACEHOLDER_SUMMARY.lower() in text.lower():
        return True
    placeholder = PLACEHOLDER_VERSIONS.get(name)
    return placeholder is not None and _release(version) == _release(placeholder)


def _broken_reason(name: str, version: str) -> str | None:
    for bad, why in BROKEN_VERSIONS.get(name, {}).items():
        if version_matches(version, bad + ".*"):
            return why
    return None


def check_neuron_packages(distributions: dict[str, str] | None = None,
                          summaries: dict[str, str] | None = None) -> dict[str, str]:
    """Refuse missing Neuron packages, PyPI placeholders and known-broken releases, with the fix.

    `distributions` maps package name -> installed version (default: read from this environment,
    with the metadata texts, summary and description, that mark placeholders). Returns the versions when they are usable;
    versions other than the pins only warn (the port was validated on the pins).
    """
    if distributions is None:
        distributions, found_summaries = installed_neuron_packages()
        summaries = found_summaries if summaries is None else summaries
    summaries = summaries or {}
    problems, placeholders = [], []
    for name in PINNED_VERSIONS:
        version = distributions.get(name)
        if version is None:
            problems.append(f"{name} is not installed")
        elif _is_placeholder(name, version, summaries.get(name)):
            placeholders.append(name)
            problems.append(f"{name} {version} is the empty PyPI placeholder (its metadata says "
                            f"'{PLACEHOLDER_SUMMARY}'), not the Neuron SDK package")
        elif (why := _broken_reason(name, version)) is not None:
            problems.append(f"{name} {version} {why}")
    if problems:
        pins = ", ".join(f"{n}=={v}" for n, v in PINNED_VERSIONS.items())
        uninstall = f"pip uninstall -y {' '.join(placeholders)} && " if placeholders else ""
        raise HarnessInputError(
            "the neuron backend cannot run: " + "; ".join(problems) + ". Install the Neuron SDK "
            f"{NEURON_SDK_RELEASE} packages from the Neuron SDK's own pip repository (PyPI only has "
            f"placeholders): {uninstall}{INSTALL_COMMAND}  (pins {pins}). The neuron backend runs "
            "on an inf2 host with the Neuron driver; on a CPU machine use --backend cpu."
        )
    off_pin = [f"{n} {distributions[n]} (pinned {p})" for n, p in PINNED_VERSIONS.items()
               if not version_matches(distributions[n], p)]
    if off_pin:
        warnings.warn("Neuron packages differ from the validated Neuron SDK "
                      f"{NEURON_SDK_RELEASE} pins: {', '.join(off_pin)}; results may differ. "
                      f"Reinstall with: {INSTALL_COMMAND}", stacklevel=2)
    return {n: distributions[n] for n in PINNED_VERSIONS}


def toolchain_version(versions: dict[str, str]) -> str:
    """One string naming the compiler and the libraries that write and read the artifacts."""
    return "; ".join(f"{name}={versions[name]}" for name in sorted(versions))


# ==== NeuronCores and pytest-xdist workers =========================================================

def _cores_from_neuron_ls(text: str) -> int:
    """Sum of nc_count over the devices `neuron-ls --json-output` lists."""
    return sum(int(device.get("nc_count", 0)) for device in json.loads(text))


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
        except (OSError, subprocess.SubprocessError, ValueError, TypeError, AttributeError):
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


def assign_visible_cores(cores_per_worker: int, environ=None, total_cores: int | None = None) -> str:
    """Set NEURON_RT_VISIBLE_CORES for this process from PYTEST_XDIST_WORKER, before the Neuron
    runtime starts. Outside xdist a value the user already set is kept."""
    environ = os.environ if environ is None else environ
    worker = environ.get("PYTEST_XDIST_WORKER")
    if worker is None and environ.get("NEURON_RT_VISIBLE_CORES"):
        return environ["NEURON_RT_VISIBLE_CORES"]
    total = neuron_core_count() if total_cores is None else total_cores
    if total == 0:
        raise HarnessInputError("no NeuronCore on this host (neuron-ls found none and there are no "
                                "/dev/neuron* devices): the neuron backend runs on inf2 with the "
                                "Neuron driver; on a CPU machine use --backend cpu")
    cores = visible_cores_for_worker(worker, cores_per_worker, total)
    environ["NEURON_RT_VISIBLE_CORES"] = cores
    return cores


# ==== the compiled-artifact cache ==================================================================

def _read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def model_source_hash() -> str:
    """sha256 over the text of the files the compiled graph is made from (MODEL_SOURCE_FILES)."""
    digest = hashlib.sha256()
    for path in MODEL_SOURCE_FILES:
        text = _read_source(path).encode("utf-8")
        digest.update(f"{path.name}\0{len(text)}\0".encode())
        digest.update(text)
    return digest.hexdigest()


def normalize_compiler_args(compiler_args=None) -> list[str]:
    """None -> the defaults; a string -> its shell words; a sequence -> a list of str."""
    if compiler_args is None:
        return list(DEFAULT_COMPILER_ARGS)
    words = shlex.split(compiler_args) if isinstance(compiler_args, str) else [str(a) for a in compiler_args]
    for word in words:
        if word.startswith("--target="):
            raise HarnessInputError(f"compiler flag {word!r}: write `--target {word.split('=', 1)[1]}` (two "
                                    "words); torch-neuronx splits the flags on whitespace to find the target")
    return words


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def artifact_cache_key(spec_hash: str, buckets, tp: int, compiler_version: str, compiler_args,
                       model_source_hash: str, capture: bool, *, max_len: int = DEFAULT_KV_LEN,
                       dtype=torch.bfloat16) -> str:
    """The cache directory name for one compiled build: readable prefix + hash of every input.

    Bucket order does not matter (the same graphs are built); compiler flag order does (neuronx-cc
    may let a later flag override an earlier one). max_len and dtype change every graph's shapes
    and types, so they are part of the key too.
    """
    buckets = sorted({int(b) for b in buckets})
    payload = {
        "format": CACHE_FORMAT, "spec": str(spec_hash), "buckets": buckets, "tp": int(tp),
        "compiler": str(compiler_version), "flags": normalize_compiler_args(compiler_args),
        "model_source": str(model_source_hash), "capture": bool(capture), "max_len": int(max_len),
        "dtype": _dtype_name(dtype),
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]
    kind = "parity" if capture else "perf"
    return f"{kind}-tp{int(tp)}-b{'_'.join(map(str, buckets))}-kv{int(max_len)}-{digest}"


def default_cache_dir() -> Path:
    from harness.checkpoint import cache_dir

    return Path(os.environ.get("GEMMA_PARITY_NEURON_CACHE", cache_dir() / "neuron"))


def cache_entry_complete(entry: Path) -> bool:
    return all((entry / name).is_file() for name in ENTRY_FILES)


def write_cache_entry(cache_dir: Path, key: str, write: Callable[[Path], None]) -> Path:
    """Have `write(tmp_dir)` fill a temporary directory beside the entry, then rename it into place.

    A failed or interrupted write leaves no entry behind. When another process (an xdist worker)
    published the same key first, its complete entry is kept and returned.
    """
    entry = Path(cache_dir) / key
    try:
        with atomic_directory(entry) as tmp:
            write(tmp)
            missing = [name for name in ENTRY_FILES if not (tmp / name).is_file()]
            if missing:
                raise NeuronBuildError(f"cache entry {key}: the writer did not produce {missing}")
    except HarnessInputError:  # the entry exists: another process published the same key first
        if not cache_entry_complete(entry):
            raise
    return entry


def read_cache_meta(entry: Path, key: str) -> dict:
    """The metadata of a cache entry, refused (with the fix) when incomplete or for another key."""
    if not cache_entry_complete(entry):
        missing = [name for name in ENTRY_FILES if not (entry / name).is_file()]
        raise HarnessInputError(f"compiled-artifact cache entry {entry} is incomplete (missing {missing}); "
                                "the harness publishes entries whole, so something else changed it. Delete that "
                                "directory and run again (the graphs will be recompiled).")
    try:
        meta = json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise HarnessInputError(f"{entry / META_FILE} is unreadable ({exc}); delete {entry} and run again") from exc
    if meta.get("key") != key or meta.get("format") != CACHE_FORMAT:
        raise HarnessInputError(f"cache entry {entry} records key {meta.get('key')!r} (format "
                                f"{meta.get('format')!r}), not {key!r}; delete {entry} and run again")
    return meta


# ==== the NxD layers of the traced module (harness/graphs.py defines the module) ====================

class NeuronLinears(RankLinears):
    """Projections as NxD parallel layers. Sizes passed in are per rank (as RankDecoder asks);
    NxD layers take the full size and divide by the TP degree themselves."""

    def __init__(self, tp: int, dtype: torch.dtype):
        super().__init__()
        self.tp, self.dtype = tp, dtype

    def column(self, in_features: int, out_per_rank: int) -> nn.Module:
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear

        return ColumnParallelLinear(in_features, out_per_rank * self.tp, bias=False, gather_output=False,
                                    dtype=self.dtype)

    def row(self, in_per_rank: int, out_features: int) -> nn.Module:
        from neuronx_distributed.parallel_layers.layers import RowParallelLinear

        # Partial sums all-reduced in fp32, as the CPU backend does (docs/design.md#backends).
        return RowParallelLinear(in_per_rank * self.tp, out_features, bias=False, input_is_parallel=True,
                                 dtype=self.dtype, reduce_dtype=torch.float32)

    def vocab(self, in_features: int, vocab_per_rank: int) -> nn.Module:
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear

        # Each rank's vocabulary slice, all-gathered on the last dim in rank order.
        return ColumnParallelLinear(in_features, vocab_per_rank * self.tp, bias=False, gather_output=True,
                                    dtype=self.dtype)

    def replicated(self, in_features: int, out_features: int) -> nn.Module:
        # A replicated KV head: a plain per-rank Linear, each rank gets the whole head's weight.
        return nn.Linear(in_features, out_features, bias=False, dtype=self.dtype)


def assemble_rank_weights(states: list[dict[str, torch.Tensor]],
                          expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                          constants: dict[str, torch.Tensor], where: str = "the compiled graph"
                          ) -> list[dict[str, torch.Tensor]]:
    """Per-rank dicts holding exactly the weights the graph reads, in its shapes and dtypes.

    A weight comes from the rank's checkpoint shard, else from the model's constant buffers; one
    the graph reads but neither provides, or of another shape, is an error naming it.
    """
    out = []
    for rank, state in enumerate(states):
        weights, missing, wrong = {}, [], []
        for name, (shape, dtype) in sorted(expected.items()):
            tensor = state.get(name, constants.get(name))
            if tensor is None:
                missing.append(name)
            elif tuple(tensor.shape) != tuple(shape):
                wrong.append(f"{name} {tuple(tensor.shape)} (graph expects {tuple(shape)})")
            else:
                weights[name] = tensor.to(dtype).contiguous()
        if missing or wrong:
            raise HarnessInputError(
                f"rank {rank}: weights do not fit {where}: "
                + (f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}; " if missing else "")
                + (f"wrong shape {wrong[:8]}; " if wrong else "")
                + "the checkpoint's spec or the sharding differs from the build (a stale cache entry?): "
                "delete the entry and run again")
        unused = sorted(set(state) - set(expected))
        if unused and rank == 0:
            warnings.warn(f"checkpoint weights {unused[:8]} are not read by {where}", stacklevel=2)
        out.append(weights)
    return out


def _checkpoint_key(tensor_meta) -> str:
    """The state/weight key exactly as NxDModel keys its buffers: the raw checkpoint key."""
    key = tensor_meta.checkpoint_key
    return key.decode("utf-8") if isinstance(key, bytes) else str(key)


# ==== the backend ==================================================================================

class NeuronBackend:
    """Runs the port on NeuronCores through NxD at tensor parallel degree `tp` (same interface as
    CpuBackend). Builds (or loads from the artifact cache) the prefill graphs of `buckets` and the
    decode graph; `capture=True` makes a parity build whose forward can also return captures."""

    name = "neuron"

    # The backend options (harness.backends.Backend): name -> converter of a --backend-option value.
    OPTIONS = {"compiler_args": str, "cache_dir": directory, "compile_workers": positive_int,
               "zero_on_reset": flag}
    reads_cache, host_ranks = True, False

    def __init__(self, checkpoint, settings: RunSettings, capture: bool = False, *, compiler_args=None,
                 cache_dir=None, compile_workers: int | None = None, zero_on_reset: bool = True):
        tp, dtype, max_len, buckets = settings.tp, settings.torch_dtype, settings.kv_len, settings.buckets
        self.versions = check_neuron_packages()  # before anything imports the SDK
        self.spec, self.tp, self.dtype, self.max_len = checkpoint.spec, tp, dtype, max_len
        plan_model(self.spec, tp)  # a layout that cannot shard fails here, before any compile
        self.graphs = graph_plan(buckets, max_len)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.capture = self.returns_captures = bool(capture)
        self.last_row_only = not self.capture  # a perf build returns only what greedy decode needs
        self.compiler_args = normalize_compiler_args(compiler_args)
        self.compile_workers = compile_workers
        self.zero_on_reset = zero_on_reset
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_key = artifact_cache_key(
            self.spec.spec_hash(), self.buckets, tp, toolchain_version(self.versions), self.compiler_args,
            model_source_hash=model_source_hash(), capture=self.capture, max_len=max_len, dtype=dtype)
        self.artifact_dir = self.cache_dir / self.cache_key
        self.visible_cores = assign_visible_cores(tp)  # before the Neuron runtime starts
        self.compiled = False  # True when this process compiled the graphs (a cache miss)
        self.timings: dict[str, float] = {}

        start = time.perf_counter()
        built = self._load_or_compile()
        self.nxd_model, self.capture_names, self.constants = built.model, built.capture_names, built.constants
        self.kv_names, self.original_weights = built.kv_names, built.weight_shapes
        self.timings["build_s" if self.compiled else "load_s"] = time.perf_counter() - start
        self.weight_specs, self.state_specs = self._graph_io()
        self._check_states()
        start = time.perf_counter()
        self._load_weights(checkpoint)
        self.timings["weights_s"] = time.perf_counter() - start
        self._zeros = {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in self.state_specs.items()
                       if key in self.kv_names}

    # -- building ------------------------------------------------------------------------------------
    def _load_or_compile(self):
        if self.artifact_dir.exists():
            return self._load_entry()
        return self._compile_entry()

    def _load_entry(self):
        from neuronx_distributed import NxDModel
        from safetensors.torch import load_file

        meta = read_cache_meta(self.artifact_dir, self.cache_key)
        if meta.get("graphs") != self.graphs:
            raise HarnessInputError(f"cache entry {self.artifact_dir} holds graphs {meta.get('graphs')}, "
                                    f"not {self.graphs}; delete it and run again")
        model = NxDModel.load(str(self.artifact_dir / MODEL_FILE))
        if not isinstance(model, NxDModel):
            raise HarnessInputError(f"{self.artifact_dir / MODEL_FILE} could not be restored as an NxDModel by "
                                    f"this neuronx-distributed ({self.versions['neuronx-distributed']}); "
                                    f"delete {self.artifact_dir} and run again to recompile")
        constants = load_file(str(self.artifact_dir / CONSTANTS_FILE))
        return Built(model, meta.get("capture_names") or None, constants, list(meta["kv_buffers"]),
                     _weight_shapes_from_json(meta["weight_shapes"]))

    def _compile_entry(self):
        from safetensors.torch import save_file

        workdir = self.cache_dir / ".work" / f"{self.cache_key}-{os.getpid()}"
        built: list[Built] = []

        def write(tmp: Path):
            built.append(self._compile(workdir))
            b = built[0]
            b.model.save(str(tmp / MODEL_FILE))
            save_file(b.constants, str(tmp / CONSTANTS_FILE))
            meta = {"format": CACHE_FORMAT, "key": self.cache_key, "graphs": self.graphs,
                    "capture_names": b.capture_names, "kv_buffers": b.kv_names,
                    "weight_shapes": _weight_shapes_to_json(b.weight_shapes), "last_row_only": self.last_row_only,
                    "compiler_args": self.compiler_args, "versions": self.versions,
                    "spec_hash": self.spec.spec_hash(), "tp": self.tp, "max_len": self.max_len,
                    "dtype": _dtype_name(self.dtype), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))

        write_cache_entry(self.cache_dir, self.cache_key, write)
        shutil.rmtree(workdir, ignore_errors=True)  # kept only when the compile failed
        self.compiled = True
        return built[0]

    def _compile(self, workdir: Path) -> "Built":
        """Trace every graph of the plan with ModelBuilder v2 and compile them -> NxDModel. The
        decode graph is the priority model: the weight layout is optimised for it (decode reads
        every weight once per token and is bandwidth-bound) and applied to the prefill graphs."""
        from neuronx_distributed import ModelBuilder, NxDParallelState

        flags = " ".join(self.compiler_args)
        try:
            # lnc_size=1: inf2's NeuronCore-v2 has one physical core per logical core. Left at None,
            # NxDParallelState asks the platform (get_platform_lnc -> torch-neuronx's platform
            # target), which fails on a build host without a Neuron device.
            with NxDParallelState(world_size=self.tp, tensor_model_parallel_size=self.tp, lnc_size=INF2_LNC):
                module = TracedDecoder(self.spec, self.tp, self.max_len, self.dtype, NeuronLinears(self.tp, self.dtype),
                                       with_captures=self.capture, last_row_only=self.last_row_only)
                module.eval()
                module.requires_grad_(False)
                constants, kv_names = constant_buffers(module), kv_buffer_names(module)  # before tracing
                weight_shapes = _module_weight_shapes(module, kv_names)  # the checkpoint layout
                builder = ModelBuilder(module)
                with torch.no_grad():
                    for tag, length in self.graphs.items():
                        builder.trace(args=example_inputs(length, self.spec.hidden_size, self.dtype,
                                                          last_row=self.last_row_only), tag=tag)
                model = builder.compile(priority_model_key=DECODE_TAG, compiler_workdir=str(workdir),
                                        compiler_args=flags, max_workers=self.compile_workers)
        except Exception as exc:
            raise NeuronBuildError(
                f"building the neuron graphs {sorted(self.graphs)} failed: {exc!r}"
                + (f" (caused by {exc.__cause__!r})" if exc.__cause__ else "")
                + f". neuronx-cc {self.versions['neuronx-cc']}, flags '{flags}'. The compiler's logs are under "
                f"{workdir} (log-neuron-cc.txt per graph); nothing was written to the artifact cache. A compiler "
                "crash (NCC_* code) on this pinned toolchain is a bug to report with those logs."
            ) from exc
        names = list(module.capture_names) if self.capture else None
        if self.capture and not names:
            raise NeuronBuildError("the parity build traced no capture points")
        return Built(model, names, constants, kv_names, weight_shapes)

    def _graph_io(self):
        """Weights and states the graphs read, named by their metaneff: name -> (shape, dtype).
        Weight shapes are the checkpoint layout recorded at build time: with weight layout
        optimisation the graphs' own weight inputs may have another layout, and set_weights takes
        the checkpoint's (NxD converts them)."""
        from torch_neuronx.proto import metaneff_pb2
        from torch_neuronx.xla_impl.trace import get_torch_dtype

        weight_type = metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT
        state_type = metaneff_pb2.MetaTensor.Type.INPUT_STATE
        weights, states = {}, {}
        for tag in self.graphs:
            for t in self.nxd_model.get_metaneff(tag).input_tensors:
                key = _checkpoint_key(t)
                if t.type == weight_type and key:
                    if key not in self.original_weights:
                        raise NeuronBuildError(f"graph {tag} reads weight {key!r}, which the traced module does "
                                               f"not have; delete {self.artifact_dir} and run again")
                    weights[key] = self.original_weights[key]
                elif t.type == state_type and key:
                    states[key] = (tuple(int(d) for d in t.shape), get_torch_dtype(t.data_type))
        return weights, states

    def _check_states(self):
        """Every device state is a KV cache or a constant buffer we can write; NxD zero-fills states."""
        unknown = sorted(set(self.state_specs) - set(self.kv_names) - set(self.constants))
        if unknown:
            raise NeuronBuildError(f"the compiled graphs keep state {unknown[:8]} that is neither KV cache "
                                   "nor a known constant; the traced module changed a buffer it should not")
        missing = sorted(set(self.kv_names) - set(self.state_specs))
        if missing:
            raise NeuronBuildError(f"KV cache buffers {missing[:8]} did not become aliased device state; "
                                   "the cache would not persist between calls")

    def _load_weights(self, checkpoint):
        states = rank_state_dicts(checkpoint, self.tp, self.dtype)
        if not self.weight_specs:
            raise NeuronBuildError(f"the compiled graphs in {self.artifact_dir} name no weights; delete the "
                                   "entry and run again")
        weights = assemble_rank_weights(states, self.weight_specs, self.constants,
                                        where=f"the compiled graphs in {self.artifact_dir}")
        del states
        self.nxd_model.set_weights(weights)
        self.nxd_model.to_neuron()
        # Constants that became state (rather than weights) start zero-filled: write their values.
        for key in sorted(set(self.state_specs) & set(self.constants)):
            shape, dtype = self.state_specs[key]
            for rank in range(self.tp):
                self.nxd_model.write_to_neuron_buffer(self.constants[key].to(dtype).reshape(shape), key, rank)

    # -- running -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the KV cache on every rank. Costs one host->device copy of the cache per rank; prefill
        never reads stale slots (causal mask), so timing runs may pass zero_on_reset=False."""
        if not self.zero_on_reset:
            return
        for rank in range(self.tp):
            for key, zeros in self._zeros.items():
                self.nxd_model.write_to_neuron_buffer(zeros, key, rank)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False,
                last: int | None = None):
        """inputs_embeds [1, s, hidden], positions [1, s] -> raw logits [1, s, vocab] (with captures
        when asked, on a parity build). s must be a compiled bucket or 1 (decode). A perf build
        returns only row `last` (the last real position; 0 for decode): [1, 1, vocab]."""
        tag, args = graph_inputs(self.spec, self.graphs, inputs_embeds, positions, self.dtype, capture=capture,
                                 parity_build=self.capture, last_row_only=self.last_row_only, last=last)
        out = self.nxd_model(*args, model_name=tag)
        return graph_result(out, self.capture_names if self.capture else None, args[0], capture,
                            self.last_row_only, last=last)

    def kv_cache(self, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer's cache on one rank, copied from the device: [1, kv_heads, max_len, d]."""
        keys = [f"layers.{layer}.self_attn.cache.{b}" for b in ("k", "v")]
        absent = [k for k in keys if k not in self.state_specs]
        if absent:
            raise HarnessInputError(f"no device buffer {absent}; KV buffers are {self.kv_names[:4]} ...")
        k, v = (self.nxd_model.read_from_neuron_buffer(key, rank) for key in keys)
        return k, v


class Built(NamedTuple):
    """What a build (or a cache entry) provides: the NxDModel and what the graphs were made from."""

    model: object
    capture_names: list[str] | None
    constants: dict[str, torch.Tensor]
    kv_names: list[str]
    weight_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]


def _module_weight_shapes(module: nn.Module, kv_names) -> dict:
    """Every tensor of the traced module that is not KV state, in the layout the module holds it
    (the per-rank checkpoint layout): name -> (shape, dtype)."""
    kv = set(kv_names)
    return {name: (tuple(t.shape), t.dtype) for name, t in [*module.named_parameters(), *module.named_buffers()]
            if name not in kv}


def _weight_shapes_to_json(shapes: dict) -> dict:
    return {name: [list(shape), _dtype_name(dtype)] for name, (shape, dtype) in sorted(shapes.items())}


def _weight_shapes_from_json(data: dict) -> dict:
    return {name: (tuple(shape), getattr(torch, dtype)) for name, (shape, dtype) in data.items()}
