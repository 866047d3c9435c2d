"""torch_neuronx.utils.get_platform_target, as neuronx-distributed calls it.

Upstream callers (neuronx-distributed Release 2.29): trace/functions.py compile() passes the flag
string, `get_platform_target(compiler_args)`; utils/model_utils.py get_platform_lnc() and
shard_checkpoint() call it with no argument and treat RuntimeError/IOError as "not a Neuron
instance". torch-neuronx's source is not public: modelled on the documented behaviour that the
target is read from the flag string split on whitespace (`--target inf2`), else from the host.
"""

from __future__ import annotations

SUPPORTED_TYPES = ("inf2", "trn1", "trn1n", "trn2", "trn3")
HOST_PLATFORM: str | None = None  # the Neuron platform of this host; None: no Neuron device (set by tests)


def get_platform_target(compiler_args: str | None = None) -> str:
    words = (compiler_args or "").split()
    if "--target" in words:
        index = words.index("--target")
        if index + 1 < len(words):
            return words[index + 1]
    if HOST_PLATFORM is None:
        raise RuntimeError("cannot determine the Neuron platform target: this host has no Neuron device "
                           "and the compiler flags name no `--target <family>`")
    return HOST_PLATFORM
