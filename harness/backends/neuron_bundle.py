"""What an HLO bundle (harness/bundle) says about Neuron: the neuronx-cc command line and flags a build
uses for a graph (the backend's own flags, harness/backends/neuron_cache.py, with the target it names),
the toolchain and runtime versions (the Neuron pip packages as installed or as pinned, and the Neuron
system packages), and, on an inf2 host, the HLO module torch-neuronx handed neuronx-cc (the
`model.MODULE_*.hlo.pb` its compile work directory keeps). Reads metadata only: imports no SDK module.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from harness.backends.neuron_cache import (DEFAULT_COMPILER_ARGS, compiler_flag_string, is_context_encoding,
                                           token_generation_flags)
from harness.backends.neuron_env import target_of
from harness.backends.neuron_packages import NEURON_SDK_RELEASE, PINNED_VERSIONS

SYSTEM_PACKAGES = ("aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-dkms", "aws-neuronx-tools")


def compile_record(tag: str, compiler_args=None) -> dict:
    """The neuronx-cc invocation of graph `tag` as the backend builds it: the flag string ModelBuilder
    passes (context encoding at the build's flags, every other graph at -O2, as NxD Inference compiles
    token generation), its target, and the equivalent command line on module.hlo.pb."""
    words = list(compiler_args or DEFAULT_COMPILER_ARGS)
    if not is_context_encoding(tag):
        words = token_generation_flags(words)
    target = target_of(words) or "inf2"
    rest = [w for k, w in enumerate(words) if w != "--target" and (k == 0 or words[k - 1] != "--target")]
    command = shlex.join(["neuronx-cc", "compile", "--framework", "XLA", "module.hlo.pb", "--target", target,
                          *rest, "--output", "module.neff"])
    return {"flags": compiler_flag_string(words), "target": target, "command": command, "graph": tag}


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _system_version(package: str) -> str | None:
    if shutil.which("dpkg-query") is None:
        return None
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def toolchain(neuronx_cc: str | None = None) -> dict:
    """The Neuron toolchain of the bundle: each pip package as installed here, else as the project pins
    it (said which); `neuronx_cc` overrides the compiler (a bundle for another release); the system
    packages as installed (none off-chip)."""
    pip, source = {}, {}
    for name, pin in PINNED_VERSIONS.items():
        found = _installed(name)
        pip[name], source[name] = (found, "installed") if found else (pin.removesuffix(".*"), "pinned")
    if neuronx_cc is not None:
        pip["neuronx-cc"], source["neuronx-cc"] = neuronx_cc, "given"
    system = {p: _system_version(p) or "not installed here" for p in SYSTEM_PACKAGES}
    return {"neuron_sdk": NEURON_SDK_RELEASE, "neuronx-cc": pip["neuronx-cc"], "pip": pip, "pip_source": source,
            "system": system}


def workdir_modules(workdir) -> list[Path]:
    """The HLO modules a torch-neuronx compile left in its work directory (what neuronx-cc was given)."""
    return sorted(Path(workdir).rglob("model.MODULE_*.hlo.pb"))
