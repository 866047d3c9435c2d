"""R at every position of a capture point: R = |port - fp32| / |bf16 reference - fp32|,
the ratio AWS's equivalence method reads. compare.compare_point leaves it on each PointResult
(position_r); distribution.py gates its distribution, precision.py reads over-precision from it."""

from __future__ import annotations

import math

import torch

# A kind is gated only where one of its points has at least MIN_POSITIONS rows (positions): the
# same row at every layer is one draw, not many (a 1-token prompt's R is one number through the
# whole model: 1.17 on a healthy census member), and a median of fewer draws moves by more than the
# gate's margin; a point names where a failure starts only over at least POINT_MIN_POSITIONS.
MIN_POSITIONS = 32
POINT_MIN_POSITIONS = 8


def position_r(dev_pos: torch.Tensor, env_pos: torch.Tensor, floor: float, pooled: float = 0.0) -> torch.Tensor:
    """R at every position (harness/judge/distribution.py reads it; not serialised): the position's
    error over its own envelope, unfloored so that a port as exact as bf16 reads 1 and one closer to
    fp32 reads below 1 (over-precision); a pooled part's envelope is at least its pooled noise. A row
    that bf16 computes exactly (envelope 0) reads 1 when the port is exact too, else its error over
    the stage's floor."""
    if not bool(torch.isfinite(dev_pos).all()):
        return torch.full_like(dev_pos, math.inf)
    env = env_pos.clamp_min(pooled)
    exact = env == 0
    return torch.where(exact, torch.where(dev_pos == 0, 1.0, dev_pos / floor), dev_pos / env.clamp_min(1e-300))


def finite_r(points) -> torch.Tensor:
    """Every position's R of `points` (PointResults carrying position_r), non-finite left out
    (a NaN point fails its own limit)."""
    parts = [p.position_r.double().flatten() for p in points if getattr(p, "position_r", None) is not None]
    if not parts:
        return torch.empty(0, dtype=torch.double)
    r = torch.cat(parts)
    return r[torch.isfinite(r)]
