"""The tensor-parallel collectives of the double (upstream: src/neuronx_distributed/parallel_layers/
mappings.py, Release 2.29): reduce_from_tensor_model_parallel_region(input_, process_group=None),
the all-reduce RowParallelLinear reduces with, and gather_from_tensor_model_parallel_region(input_,
process_group=None) / gather_from_tensor_model_parallel_region_with_dim(input_, gather_dim,
process_group=None), the all-gathers. Rules modelled: one TP group (process_group must stay None);
a group of one passes the input through; the reduce sums in the input's dtype (callers cast to
their reduce dtype first, as RowParallelLinear does). While tracing they produce the right shapes;
while the double executes a graph, the ranks' partial results really cross (parallel_state).
"""

from __future__ import annotations

import torch

from . import parallel_state as ps


def _one_group(process_group) -> None:
    if process_group is not None:
        raise NotImplementedError("the NxD double models the one tensor-parallel group only (process_group=None)")


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    _one_group(process_group)
    return ps.all_reduce(input_)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    _one_group(process_group)
    return ps.all_gather_dim(input_, input_.dim() - 1)


def gather_from_tensor_model_parallel_region_with_dim(input_: torch.Tensor, gather_dim: int,
                                                      process_group=None) -> torch.Tensor:
    _one_group(process_group)
    return ps.all_gather_dim(input_, gather_dim)
