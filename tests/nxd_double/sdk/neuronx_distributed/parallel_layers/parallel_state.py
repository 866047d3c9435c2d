"""Parallel state of the double (upstream: src/neuronx_distributed/parallel_layers/parallel_state.py,
Release 2.29: initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
context_parallel_size=1, expert_model_parallel_size=1, skip_collective_init=False, lnc_size=1,
mesh_only=False), model_parallel_is_initialized, get_tensor_model_parallel_size/_rank,
destroy_model_parallel).

Tensor parallelism only. Rules modelled:
- initialize_model_parallel asks torch-neuronx for the platform on every call
  (`_HARDWARE_TYPE = hardware(get_platform_target())`, upstream ~line 560), whatever lnc_size is:
  on a host without a Neuron device it fails unless $NEURON_PLATFORM_TARGET_OVERRIDE names one.
- One SPMD trace, made as rank 0 of a mocked group, is what every rank runs: the Python rank
  (`get_tensor_model_parallel_rank`) is 0 while tracing and stays 0 while the double executes the
  graph on each rank, so rank-dependent Python is baked as rank 0 (as upstream's
  `_split_along_dim` slices by `group.rank()`, a Python int, at trace time).
Collectives: while a graph is traced they only produce the right shapes; while the double executes
a graph, each rank's thread holds its own `RankGroup` (the CPU backend's ThreadGroup underneath) so
partial results really cross between ranks, in rank order, as the device's collectives do.
"""

from __future__ import annotations

import threading

import torch

from torch_neuronx.utils import get_platform_target

from harness.backends.cpu import ThreadGroup

_STATE: dict = {}
# upstream utils/utils.py `hardware`: inf2 and trn1n map to the trn1 hardware type
HARDWARE = {"trn1": "trn1", "trn1n": "trn1", "inf2": "trn1", "trn2": "trn2", "trn3": "trn3"}
_RUNTIME = threading.local()  # .group: RankGroup of the executing rank, absent while tracing


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              skip_collective_init: bool = False, lnc_size: int = 1, mesh_only: bool = False):
    if pipeline_model_parallel_size != 1 or context_parallel_size != 1 or expert_model_parallel_size != 1:
        raise NotImplementedError("the NxD double models tensor parallelism only")
    if lnc_size not in (1, 2):
        raise ValueError(f"lnc_size {lnc_size!r}: must be 1 or 2")
    hardware = HARDWARE[get_platform_target()]  # every call, as upstream
    _STATE.update(tp=int(tensor_model_parallel_size), lnc=int(lnc_size), hardware=hardware)


def model_parallel_is_initialized() -> bool:
    return "tp" in _STATE


def _require():
    # upstream get_tensor_model_parallel_group asserts the group exists
    assert model_parallel_is_initialized(), "tensor model parallel group is not initialized"


def get_tensor_model_parallel_size() -> int:
    group = current_group()
    if group is not None:  # executing: the size the trace baked in
        return group.size
    _require()
    return _STATE["tp"]


def get_lnc_size() -> int:
    _require()
    return _STATE["lnc"]


def get_tensor_model_parallel_rank() -> int:
    return 0  # the SPMD trace is made as rank 0 and replayed on every rank


def destroy_model_parallel() -> None:
    _STATE.clear()


class RankGroup:
    """One rank's view of a TP group during execution: real exchanges through a ThreadGroup."""

    def __init__(self, threads: ThreadGroup, rank: int):
        self.threads, self.rank, self.size = threads, rank, threads.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.threads.exchange(self.rank, x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part  # summed in x's dtype (the layer casts to reduce_dtype first)
        return total


def current_group():
    return getattr(_RUNTIME, "group", None)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    group = current_group()
    if group is None:
        return x.clone()
    return x if group.size == 1 else group.all_reduce(x)  # upstream _reduce: a group of one passes through


def all_gather_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    group = current_group()
    if group is None:  # tracing: the right shape; the values are never used
        return torch.cat([x] * get_tensor_model_parallel_size(), dim=dim)
    return torch.cat(group.threads.exchange(group.rank, x), dim=dim)


def scatter_last(x: torch.Tensor) -> torch.Tensor:
    group = current_group()
    tp = get_tensor_model_parallel_size() if group is None else group.size
    return torch.chunk(x, tp, dim=-1)[get_tensor_model_parallel_rank()]
