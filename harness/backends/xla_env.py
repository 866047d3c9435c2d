"""The XLA backend's runtime: torch-xla on the CPU PJRT device with two devices in SPMD mode (one
per rank at TP=2), imported once per process, and the in-graph collectives of one rank's graph
(all-reduce in fp32, all-gather) over the replica group of all ranks. With xla_lower.py and xla.py
the only modules of the project that import torch_xla.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import SimpleNamespace

import torch

from harness.base.errors import HarnessInputError
from harness.port.model import Collectives

TORCH_XLA_VERSION = "2.9.0"  # keep in step with pyproject's `xla` extra
INSTALL_COMMAND = (f"pip install torch=={TORCH_XLA_VERSION} torch-xla=={TORCH_XLA_VERSION} "
                   "(or, in a checkout: pip install torch==2.9.0 -e '.[xla]')")
CPU_DEVICES = 2  # XLA CPU devices in the process: one per rank at TP=2


@functools.lru_cache(maxsize=None)
def xla_runtime() -> SimpleNamespace:
    """Import torch_xla on the CPU PJRT device with two devices in SPMD mode, once per process.

    A missing or mismatched torch-xla is bad input (exit 2) with the install command."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", str(CPU_DEVICES))
    if os.environ["PJRT_DEVICE"] != "CPU":
        raise HarnessInputError(f"the xla backend runs XLA on CPU but PJRT_DEVICE={os.environ['PJRT_DEVICE']}; "
                                "unset it or set PJRT_DEVICE=CPU")
    try:
        import torch_xla
        import torch_xla.debug.metrics as metrics
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except Exception as exc:  # ImportError, or an ABI mismatch with this torch (OSError, undefined symbol)
        raise HarnessInputError(
            f"the xla backend needs torch-xla {TORCH_XLA_VERSION} with torch {TORCH_XLA_VERSION} (the Neuron "
            f"host's torch); this environment has torch {torch.__version__} and importing torch_xla failed "
            f"({exc!r}). Install them in a separate environment: {INSTALL_COMMAND}") from exc
    _no_jax_bridge()
    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    return SimpleNamespace(torch_xla=torch_xla, xs=xs, xr=xr, metrics=metrics, device=torch_xla.device(),
                           devices=devices)


def _no_jax_bridge() -> None:
    """torch-xla 2.9's mark_sharding tries `import torchax` and `import jax` on every call (its JAX
    bridge, torch_xla/_internal/jax_workarounds.py). Without jax that import fails, is not cached,
    and is retried for each of the ~180 tensors a step places: a third of a family check's time in
    the XLA lane. torchax needs jax, so without jax both imports can only fail: record that once."""
    if importlib.util.find_spec("jax") is None:
        sys.modules.setdefault("jax", None)
        sys.modules.setdefault("torchax", None)


class XlaCollectives(Collectives):
    """In-graph collectives of one rank's graph over the replica group of all `tp` ranks."""

    def __init__(self, tp: int):
        self.tp, self.groups = tp, [list(range(tp))]

    def all_reduce(self, x):
        if self.tp == 1:
            return x
        xlac = xla_runtime().torch_xla._XLAC
        # fp32 partial sums (XLA's CPU all-reduce refuses bf16; NxD's reduce_dtype), cast back.
        return xlac._xla_spmd_all_reduce("sum", x.float(), 1.0, self.groups).to(x.dtype)

    def all_gather(self, x, dim):
        if self.tp == 1:
            return x
        xlac = xla_runtime().torch_xla._XLAC
        # (input, dim, shard_count, groups, pin_layout, channel_id, use_global_device_ids)
        return xlac._xla_all_gather(x, dim % x.dim(), self.tp, self.groups, False, 1, True)
