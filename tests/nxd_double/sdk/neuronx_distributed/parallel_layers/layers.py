"""ColumnParallelLinear / RowParallelLinear of the double.

Upstream: src/neuronx_distributed/parallel_layers/layers.py (neuronx-distributed Release 2.29).
Signatures (names, order, defaults) as upstream:
  ColumnParallelLinear(input_size, output_size, bias=True, gather_output=True, dtype=torch.float32,
      device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
      sequence_dimension=None, keep_master_weight=False, skip_bias_add=False, pad=False,
      pad_alignment_size_per_rank=1, keep_padded_output=False, tensor_model_parallel_group=None,
      reduce_dtype=torch.float32, rank_ordering=None)
  RowParallelLinear(input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32,
      device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
      sequence_dimension=None, keep_master_weight=False, skip_bias_add=False, pad=False,
      reduce_output=True, tensor_model_parallel_group=None, reduce_dtype=torch.float32,
      tile_cc=False, rank_ordering=None)
Rules modelled: sizes are the full sizes, divided by the TP degree (an indivisible size is an
error, as upstream's `divide`); weights (out/tp, in) and (out, in/tp); column bias of out (gathered)
or out/tp; gather_output all-gathers on the last dim; input_is_parallel=False splits the input's
last dim; the row output is cast to reduce_dtype, all-reduced, cast back (both through
mappings.py, as upstream); forward(input,
slice_indices=None). Options the double does not model must stay at their defaults.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import parallel_state as ps
from .mappings import gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise AssertionError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def _unmodelled(**options):
    set_ = {k: v for k, v in options.items() if v}
    if set_:
        raise NotImplementedError(f"the NxD double does not model {sorted(set_)}")


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, device=None,
                 stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None,
                 keep_master_weight=False, skip_bias_add=False, pad=False, pad_alignment_size_per_rank=1,
                 keep_padded_output=False, tensor_model_parallel_group=None, reduce_dtype=torch.float32,
                 rank_ordering=None):
        super().__init__()
        _unmodelled(stride=stride != 1, sequence_parallel_enabled=sequence_parallel_enabled, pad=pad,
                    skip_bias_add=skip_bias_add, tensor_model_parallel_group=tensor_model_parallel_group,
                    rank_ordering=rank_ordering)
        tp = ps.get_tensor_model_parallel_size()
        self.input_size, self.output_size, self.gather_output = input_size, output_size, gather_output
        self.output_size_per_partition = _divide(output_size, tp)
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else dtype
        self.weight = nn.Parameter(torch.zeros(self.output_size_per_partition, input_size, dtype=dtype, device=device))
        bias_size = output_size if gather_output else self.output_size_per_partition
        self.bias = nn.Parameter(torch.zeros(bias_size, dtype=dtype, device=device)) if bias else None

    def forward(self, input, slice_indices=None):
        weight = self.weight if slice_indices is None else self.weight[slice_indices, :]
        output = F.linear(input, weight)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output + self.bias if self.bias is not None else output


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32,
                 device=None, stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None,
                 keep_master_weight=False, skip_bias_add=False, pad=False, reduce_output=True,
                 tensor_model_parallel_group=None, reduce_dtype=torch.float32, tile_cc=False, rank_ordering=None):
        super().__init__()
        _unmodelled(stride=stride != 1, sequence_parallel_enabled=sequence_parallel_enabled, pad=pad,
                    skip_bias_add=skip_bias_add, tensor_model_parallel_group=tensor_model_parallel_group,
                    tile_cc=tile_cc, rank_ordering=rank_ordering)
        tp = ps.get_tensor_model_parallel_size()
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.reduce_output = input_is_parallel, reduce_output
        self.input_size_per_partition = _divide(input_size, tp)
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else dtype
        self.weight = nn.Parameter(torch.zeros(output_size, self.input_size_per_partition, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device)) if bias else None

    def forward(self, input_, slice_indices=None):
        x = input_ if self.input_is_parallel else ps.scatter_last(input_)
        weight = self.weight if slice_indices is None else self.weight[:, slice_indices]
        output = F.linear(x, weight)
        if self.reduce_output:
            dtype = output.dtype
            output = reduce_from_tensor_model_parallel_region(output.to(self.reduce_dtype)).to(dtype)
        return output + self.bias if self.bias is not None else output
