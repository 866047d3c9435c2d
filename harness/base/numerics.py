"""Numerics shared by the port and its judge: the host softcap, the embedding scale, bf16 spacing.

The lowest layer of the harness besides the spec: both the engine (which serves probabilities) and
compare.py (which judges them) use these, so neither has to reach into the other.
"""

from __future__ import annotations

import math

import torch

BF16_MANTISSA_BITS = 7  # bf16: 8 significant bits, 7 stored


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), in fp32; identity when the config has no softcap."""
    if cap is None:
        return logits.float()
    return cap * torch.tanh(logits.float() / cap)


def embed_scale(hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(hidden) cast to the weight dtype first: in bf16, sqrt(3840) = 61.97 becomes 62.0."""
    return torch.tensor(hidden_size ** 0.5).to(dtype)


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    x = abs(x)
    if x == 0 or not math.isfinite(x):
        return 2.0 ** -133
    return 2.0 ** (math.floor(math.log2(x)) - BF16_MANTISSA_BITS)
