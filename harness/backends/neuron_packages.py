"""The Neuron SDK packages this host has, read from their installed metadata without importing
them: the versions the project is validated against (pyproject's `neuron` extra), the empty PyPI
placeholders that share the SDK's names, and releases known to be broken. The backend's version
guard and `gemma-parity doctor` both use these."""

from __future__ import annotations

import re
import warnings
from importlib import metadata

from harness.base.errors import HarnessInputError

# ---- versions: keep in step with pyproject's `neuron` extra ------------------------------------

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


def package_problems(distributions: dict[str, str], summaries: dict[str, str] | None = None
                     ) -> tuple[list[str], list[str]]:
    """(problems, placeholders): one sentence per missing package, PyPI placeholder or known-broken
    release among the pinned Neuron packages, and the placeholder names (to uninstall first)."""
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
    return problems, placeholders


def install_fix(placeholders=()) -> str:
    """The command that installs the pinned Neuron packages (after removing placeholders)."""
    uninstall = f"pip uninstall -y {' '.join(placeholders)} && " if placeholders else ""
    return f"{uninstall}{INSTALL_COMMAND}"


def off_pin(distributions: dict[str, str]) -> list[str]:
    """Installed versions other than the validated pins: 'name version (pinned pin)'."""
    return [f"{n} {distributions[n]} (pinned {p})" for n, p in PINNED_VERSIONS.items()
            if n in distributions and not version_matches(distributions[n], p)]


def check_neuron_packages(distributions: dict[str, str] | None = None,
                          summaries: dict[str, str] | None = None) -> dict[str, str]:
    """Refuse missing Neuron packages, PyPI placeholders and known-broken releases, with the fix.

    `distributions` maps package name -> installed version (default: read from this environment,
    with the metadata texts, summary and description, that mark placeholders). Returns the versions
    when they are usable; versions other than the pins only warn (the port was validated on the pins).
    """
    if distributions is None:
        distributions, found_summaries = installed_neuron_packages()
        summaries = found_summaries if summaries is None else summaries
    problems, placeholders = package_problems(distributions, summaries)
    if problems:
        pins = ", ".join(f"{n}=={v}" for n, v in PINNED_VERSIONS.items())
        raise HarnessInputError(
            "the neuron backend cannot run: " + "; ".join(problems) + ". Install the Neuron SDK "
            f"{NEURON_SDK_RELEASE} packages from the Neuron SDK's own pip repository (PyPI only has "
            f"placeholders): {install_fix(placeholders)}  (pins {pins}). The neuron backend runs "
            "on an inf2 host with the Neuron driver; on a CPU machine use --backend cpu."
        )
    if off := off_pin(distributions):
        warnings.warn("Neuron packages differ from the validated Neuron SDK "
                      f"{NEURON_SDK_RELEASE} pins: {', '.join(off)}; results may differ. "
                      f"Reinstall with: {INSTALL_COMMAND}", stacklevel=2)
    return {n: distributions[n] for n in PINNED_VERSIONS}


def toolchain_version(versions: dict[str, str]) -> str:
    """One string naming the compiler and the libraries that write and read the artifacts."""
    return "; ".join(f"{name}={versions[name]}" for name in sorted(versions))
