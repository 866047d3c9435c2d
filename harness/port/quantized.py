"""The quantized port's projections: int8 weights and fp32 scales held per rank, dequantized to the
activation dtype before the matmul (harness/inputs/quantize.py is the scheme; docs/quantization.md).

Shapes and sharding are the unquantized layers' (harness/port/sharding.py splits each scale with
its weight's rows: column-parallel scales split, row-parallel ones replicated). The lm_head stays a
full-precision VocabParallel layer (the scheme keeps it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.inputs.quantize import SCALE_DTYPE, STORAGE_DTYPE, dequantize, scheme_of
from harness.port.model import Collectives, RankLinears


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(weight, scale, x.dtype).T: int8 `weight` [out, in] and fp32 `scale`
    [out, 1], both parameters (weights a compiled graph reads, never folded into constants). The
    scale stays fp32 whatever dtype the module is cast to."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=STORAGE_DTYPE), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(out_features, 1, dtype=SCALE_DTYPE), requires_grad=False)

    def _apply(self, fn, recurse=True):
        scale = self.scale.data
        super()._apply(fn, recurse)
        moved = self.scale.data
        if moved.dtype != SCALE_DTYPE:  # a dtype cast of the module: keep the scale's values and dtype
            self.scale.data = scale.to(moved.device)
        return self

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale, dtype)

    def forward(self, x):
        return F.linear(x, self.dequantized(x.dtype))


class QuantizedRowParallel(QuantizedLinear):
    """Input split across ranks: each rank's partial product of its dequantized columns, summed by
    an all-reduce (the scales, per output row, are the same on every rank)."""

    def __init__(self, in_features: int, out_features: int, collectives: Collectives):
        super().__init__(in_features, out_features)
        self.collectives = collectives

    def forward(self, x):
        return self.collectives.all_reduce(super().forward(x))


class QuantizedProjections:
    """The scheme's projections of a rank's linears factory (mixed into the cpu/xla factory here and
    the Neuron one in harness/backends/neuron_layers.py): column, replicated and row projections
    quantized; lm_head (vocab) left to the factory it is mixed into, unquantized."""

    def column(self, in_features: int, out_per_rank: int) -> nn.Module:
        return QuantizedLinear(in_features, out_per_rank)

    def replicated(self, in_features: int, out_features: int) -> nn.Module:
        return QuantizedLinear(in_features, out_features)

    def row(self, in_per_rank: int, out_features: int) -> nn.Module:
        return QuantizedRowParallel(in_per_rank, out_features, self.collectives)


class QuantizedLinears(QuantizedProjections, RankLinears):
    """RankLinears with the scheme's projections quantized; lm_head (vocab) as unquantized."""


def quantized(quantize: str | None) -> dict:
    """The keywords sharding.rank_state_dicts takes for `--quantize`: none for the unquantized port
    (its call is what it always was), the scheme's name otherwise (an unknown one refused here)."""
    scheme_of(quantize)
    return {} if quantize is None else {"quantize": quantize}
