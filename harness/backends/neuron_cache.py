"""The Neuron backend's compiler flags and its compiled-artifact cache.

Flags: what the backend passes to ModelBuilder.compile, kept as the user's words and joined shell-
style, so a quoted value (NxD-Inference's `--tensorizer-options='--a --b'`) reaches neuronx-cc as one
word. Cache: one directory per build, named by a key of everything that changes the compiled graphs
(spec, buckets, TP, KV length, dtype, build kind, toolchain and runtime versions, flags, the compile-
time environment, the model source), published whole (harness/base/atomic.py). Weights are never part of
an entry: they are loaded per run.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
from pathlib import Path
from typing import Callable

import torch

from harness.base.atomic import atomic_directory
from harness.base.errors import HarnessInputError
from harness.base.settings import DEFAULT_KV_LEN
from harness.port.graphs import PREFILL_TAG, GraphBuildError

# ---- compiler flags -----------------------------------------------------------------------------

# ModelBuilder.compile passes these to neuronx-cc as given. It adds --auto-cast=none and -O1 only
# when absent, plus --verbose=35 and --logfile=<workdir>/log-neuron-cc.txt; it never adds a target.
# Its own no-argument default starts with --enable-saturate-infinity, which passing flags replaces,
# so it is listed here (NxD-Inference's models pass it too; NeuronCore-v2, inf2's core, needs it to
# saturate +-inf instead of producing NaN). torch-neuronx reads the platform from the flag string
# split on whitespace: only `--target inf2` (two words) is seen; `--target=inf2` is not, and the
# target then comes from the host (which fails on a build host without a Neuron device).
DEFAULT_COMPILER_ARGS = ("--enable-saturate-infinity", "--model-type=transformer", "--auto-cast=none", "-O1",
                         "--target", "inf2")


def normalize_compiler_args(compiler_args=None) -> list[str]:
    """None -> the defaults; a string -> its shell words (quotes group a value with spaces, as in
    `--tensorizer-options='--a --b'`); a sequence -> a list of str, one word each."""
    if compiler_args is None:
        return list(DEFAULT_COMPILER_ARGS)
    if isinstance(compiler_args, str):
        try:
            words = shlex.split(compiler_args)
        except ValueError as exc:
            raise HarnessInputError(f"compiler flags {compiler_args!r}: {exc} (close the quote)") from exc
    else:
        words = [str(a) for a in compiler_args]
    for word in words:
        if word.startswith("--target="):
            raise HarnessInputError(f"compiler flag {word!r}: write `--target {word.split('=', 1)[1]}` (two "
                                    "words); torch-neuronx splits the flags on whitespace to find the target")
    return words


def compiler_flag_string(words: list[str]) -> str:
    """The one string ModelBuilder.compile takes, from the flag words: shell-quoted where a word holds
    spaces, so the compiler's shell-style split gives the same words back (a plain ' '.join would
    cut `--tensorizer-options=--a --b` into two flags, the second unknown to neuronx-cc)."""
    return shlex.join(words)


def token_generation_flags(compiler_args: list[str]) -> list[str]:
    """`compiler_args` at -O2 (their -O level replaced, or added): the default flags of every graph
    but context encoding, as NxD Inference compiles token generation (model_wrapper.py)."""
    words = [w for w in compiler_args if not re.fullmatch(r"-O\d", w)]
    return [*words, "-O2"]


def decode_flags(compiler_args: list[str], decode_compiler_args) -> list[str]:
    """The flag words of every graph but context encoding (decode, verify, draft):
    token_generation_flags(`compiler_args`) when not given; refused unless they name the same
    --target (the build's platform comes from the flags: neuron_env.build_platform)."""
    if decode_compiler_args is None:
        return token_generation_flags(compiler_args)
    words = normalize_compiler_args(decode_compiler_args)

    def target(w):
        return w[w.index("--target") + 1] if "--target" in w[:-1] else None
    if target(words) != target(compiler_args):
        raise HarnessInputError(f"decode_compiler_args {shlex.join(words)!r} name target {target(words)!r}, the "
                                f"other graphs' flags {target(compiler_args)!r}: give `--target "
                                f"{target(compiler_args)}` in both")
    return words


def is_context_encoding(tag: str) -> bool:
    """A prefill bucket's graph (graphs.PREFILL_TAG, with any KV-bucket or batch suffix)."""
    return tag.startswith(PREFILL_TAG.split("{")[0])


def per_graph_flags(tags, compiler_args: list[str], decode_args: list[str]) -> dict[str, str]:
    """ModelBuilder tag -> its flag string: `compiler_args` for context encoding (the prefill
    buckets), `decode_args` for every other graph (decode, speculative verify, draft), as NxD
    Inference compiles all but context encoding at -O2."""
    return {tag: compiler_flag_string(compiler_args if is_context_encoding(tag) else decode_args) for tag in tags}


# ---- the compiled-artifact cache ----------------------------------------------------------------

CACHE_FORMAT = 3  # bump when the layout of a cache entry changes (3: no constants file, rope in the graph)
MODEL_FILE = "nxd_model.pt"
META_FILE = "artifact.json"
ENTRY_FILES = (MODEL_FILE, META_FILE)
_HARNESS_DIR = Path(__file__).resolve().parent.parent
def _harness_imports(path: Path) -> set[Path]:
    """The harness modules `path` imports (any import statement in it, module level or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "harness":
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "harness"}
    found = set()
    for name in names:
        base = _HARNESS_DIR.parent.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                found.add(candidate)
    return found


def source_closure(roots, leaves=(), without=()) -> tuple[Path, ...]:
    """Every harness module `roots` import, transitively, plus `leaves` (files whose own imports are
    host-side), less `without`; never harness/base/ (errors, settings, numerics: no graph code, and
    what they decide that shapes a graph, the KV length, dtype, buckets, flags, is a field of the
    key itself). Sorted, so the hash does not depend on the walk's order."""
    base_dir, seen, stack = _HARNESS_DIR / "base", set(), list(roots)
    while stack:
        path = stack.pop()
        if path in seen or base_dir in path.parents:
            continue
        seen.add(path)
        stack.extend(_harness_imports(path))
    return tuple(sorted((seen | set(leaves)) - set(without)))


# The source the compiled graph is made from: the import closure of the traced module's definition
# (port/graphs.py: the decoder, its KV slots, the device plan, the spec and sharding it bakes in)
# and of NxD's layers (neuron_layers.py), plus neuron.py and neuron_build.py, which build it. Derived: an
# edit to any module the graph code imports changes the key (a hand list left kv_slots.py and
# device_plan.py out, and old NEFFs were reused after an edit to either).
MODEL_SOURCE_FILES = source_closure([_HARNESS_DIR / "port" / "graphs.py", _HARNESS_DIR / "backends" / "neuron_layers.py"],
                                    leaves=[_HARNESS_DIR / "backends" / "neuron.py",
                                            _HARNESS_DIR / "backends" / "neuron_build.py"])
# The source of a fused build's draft graphs (RunSettings.assistant, neuron_drafter.py): hashed into the
# drafter's part of the key only, so a target-only entry's key does not move with the drafter's code.
DRAFTER_SOURCE_FILES = source_closure([_HARNESS_DIR / "port" / "draft_graphs.py"],
                                      leaves=[_HARNESS_DIR / "backends" / "neuron_drafter.py"],
                                      without=MODEL_SOURCE_FILES)
# Every file the artifact key depends on: the graph's source (MODEL_SOURCE_FILES, hashed into the key),
# this module (CACHE_FORMAT, the default flags, the key's layout) and the pinned toolchain (the
# compiler version in the key). The CI workflow's cache key is `python -m harness.backends.neuron_cache`
# (ci_cache_key), a hash of exactly these files: one list for both, so no change to an input of the
# key can leave CI restoring a stale directory and never saving the recompiled one.
ARTIFACT_KEY_FILES = (*MODEL_SOURCE_FILES, *DRAFTER_SOURCE_FILES, Path(__file__).resolve(),
                      _HARNESS_DIR / "backends" / "neuron_packages.py", _HARNESS_DIR.parent / "pyproject.toml")


def ci_cache_key(files=ARTIFACT_KEY_FILES) -> str:
    """sha256 over the names and bytes of `files` (relative to the repository): the CI cache key's hash."""
    digest = hashlib.sha256()
    for path in files:
        data = Path(path).read_bytes()
        digest.update(f"{Path(path).relative_to(_HARNESS_DIR.parent)}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


# Environment variables read while compiling: flags neuronx-cc or torch-xla add on their own
# (NEURON_CC_FLAGS, XLA_FLAGS), NxD's layout options, and the platform and LNC NxD asks for.
COMPILE_ENV_VARS = ("NEURON_CC_FLAGS", "XLA_FLAGS", "NXD_LAYOUT_TRANSFORMATION_OPTIONS",
                    "NEURON_PLATFORM_TARGET_OVERRIDE", "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VIRTUAL_CORE_SIZE")


def compile_environment(runtime_version: str, environ=None) -> dict[str, str]:
    """What the compile reads besides its arguments: the COMPILE_ENV_VARS that are set, and the Neuron
    runtime version (the runtime loads what the compiler wrote)."""
    environ = os.environ if environ is None else environ
    found = {name: environ[name] for name in COMPILE_ENV_VARS if environ.get(name)}
    return {**found, "neuron-runtime": str(runtime_version)}


def _read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def model_source_hash(files=MODEL_SOURCE_FILES) -> str:
    """sha256 over the text of the files the compiled graph is made from (MODEL_SOURCE_FILES)."""
    digest = hashlib.sha256()
    for path in files:
        text = _read_source(path).encode("utf-8")
        digest.update(f"{path.name}\0{len(text)}\0".encode())
        digest.update(text)
    return digest.hexdigest()


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def artifact_cache_key(spec_hash: str, buckets, tp: int, compiler_version: str, compiler_args,
                       model_source_hash: str, capture: bool, *, max_len: int = DEFAULT_KV_LEN,
                       dtype=torch.bfloat16, environment: dict | None = None, sliding_cache: str = "linear",
                       kv_graphs: dict | None = None, drafter: dict | None = None) -> str:
    """The cache directory name for one compiled build: readable prefix + hash of every input.

    Bucket order does not matter (the same graphs are built); compiler flag order does (neuronx-cc
    may let a later flag override an earlier one). max_len and dtype change every graph's shapes
    and types, so they are part of the key too; `environment` is `compile_environment()`. `kv_graphs`
    (tag -> (length, KV bucket)) is the KV-bucket plan: which slots each graph reads. `drafter`
    (neuron_drafter.drafter_key) is a fused build's assistant, k and draft graphs.
    """
    buckets = sorted({int(b) for b in buckets})
    payload = {
        "format": CACHE_FORMAT, "spec": str(spec_hash), "buckets": buckets, "tp": int(tp),
        "compiler": str(compiler_version), "flags": normalize_compiler_args(compiler_args),
        "model_source": str(model_source_hash), "capture": bool(capture), "max_len": int(max_len),
        "dtype": _dtype_name(dtype), "environment": dict(sorted((environment or {}).items())),
    }
    if kv_graphs is not None:  # graphs reading other KV buckets are other graphs
        payload["kv_graphs"] = {str(t): [int(n), int(kv)] for t, (n, kv) in sorted(kv_graphs.items())}
    if drafter is not None:  # a fused build (the drafter's graphs in the target's model) is another build
        payload["drafter"] = drafter
    if sliding_cache != "linear":  # a ring changes the sliding layers' state shapes and graphs
        payload["sliding_cache"] = str(sliding_cache)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]
    kind = "parity" if capture else "perf"
    return f"{kind}-tp{int(tp)}-b{'_'.join(map(str, buckets))}-kv{int(max_len)}-{digest}"


def default_cache_dir() -> Path:
    from harness.inputs.tiny import cache_dir

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
                raise GraphBuildError(f"cache entry {key}: the writer did not produce {missing}")
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




if __name__ == "__main__":  # the CI workflow's compile-cache key (.github/workflows/inf2.yml)
    print(ci_cache_key())
