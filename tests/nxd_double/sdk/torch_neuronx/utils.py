"""torch_neuronx.utils.get_platform_target, as neuronx-distributed calls it.

Upstream callers (neuronx-distributed Release 2.29): trace/functions.py compile() and
compile_layout_transformer() pass the flag string, `get_platform_target(compiler_args)`;
parallel_layers/parallel_state.py initialize_model_parallel() and utils/model_utils.py
get_platform_lnc() call it with no argument. torch-neuronx's source is not public: modelled on the
documented behaviour that the target is read from the flag string split on whitespace
(`--target inf2`), else from $NEURON_PLATFORM_TARGET_OVERRIDE (which NxD's and NxD-Inference's
tests set to compile for a platform the host is not), else from the host's Neuron device.
"""

from __future__ import annotations

import os

SUPPORTED_TYPES = ("inf2", "trn1", "trn1n", "trn2", "trn3")
HOST_PLATFORM: str | None = None  # the Neuron platform of this host; None: no Neuron device (set by tests)
OVERRIDE_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
QUERIES: list[str | None] = []  # every call's flag string (None: no argument), for tests to inspect


def get_platform_target(compiler_args: str | None = None) -> str:
    QUERIES.append(compiler_args)
    words = (compiler_args or "").split()
    if "--target" in words:
        index = words.index("--target")
        if index + 1 < len(words):
            return words[index + 1]
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        if override not in SUPPORTED_TYPES:
            raise RuntimeError(f"{OVERRIDE_ENV}={override!r} is not a supported platform {SUPPORTED_TYPES}")
        return override
    if HOST_PLATFORM is None:
        raise RuntimeError("cannot determine the Neuron platform target: this host has no Neuron device, "
                           f"the compiler flags name no `--target <family>` and {OVERRIDE_ENV} is not set")
    return HOST_PLATFORM
