"""The port's own path: transformers' computation of one decision alone, fed the very input the port
had at it, in fp32 and bf16, for the judge to decide a departing choice by (tokens.own_path_choice,
docs/judging.md#a-departure-decided-on-the-ports-own-path):

- an MoE router (`router_alone`): transformers' router on the port's `layers.{i}.attn_residual`
  rows, every row (a router is one small projection);
- the head (`OwnPath.head`): transformers' final norm and lm_head on the port's last layer output
  at one row, only where a token departs (a head is the vocabulary wide).

As the local verdicts and the bit-exact stage run a layer alone (harness/parity/local.py,
harness/parity/layer_bits.py), the upstream path is not judged here: the capture points judge it by
the envelope. Here only the last step is: whether the port's choice is what transformers makes of
the same input.
"""

from __future__ import annotations

import torch

from harness.base.points import Point
from harness.reference.layers import ReferenceLayers


def router_alone(reference: ReferenceLayers, rows: dict, spec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per router point (`[decode.]layers.{i}.router_logits`) found in `rows` (point name -> the
    port's rows, stacked as the observation stacks them), transformers' router alone on the port's
    `attn_residual` rows of that layer: (fp32 logits, bf16 logits) [rows, experts]."""
    out = {}
    for layer in spec.layers:
        for decode in (False, True):
            logits = Point("layer", layer.index, "router_logits", decode).name
            x = rows.get(Point("layer", layer.index, "attn_residual", decode).name)
            if logits in rows and x is not None:
                out[logits] = tuple(reference.router_logits(layer.index, x, dtype)
                                    for dtype in (torch.float32, torch.bfloat16))
    return out


class OwnPath:
    """transformers' head alone on the port's input to it, per prompt and row, on demand: `head(k,
    where, row)` with where "prefill" (a prompt row) or "decode" (a teacher-forced step; step 0 is
    the prefill's last row, as the engine computes it) -> (fp32 logits, bf16 logits) [vocab], or
    None where the port's run captured no last layer output there."""

    def __init__(self, checkpoint, runs: list):
        self.reference, self.runs = ReferenceLayers(checkpoint), runs
        self.last = Point("layer", checkpoint.spec.num_layers - 1, "output").name
        self._weight = None

    def _input(self, k: int, where: str, row: int) -> torch.Tensor | None:
        forced = self.runs[k].forced
        prefill = forced.prefill.captures.get(self.last) if forced.prefill is not None else None
        if prefill is None:
            return None
        if where == "prefill" or row == 0:
            return prefill[row if where == "prefill" else -1]
        steps = (forced.step_captures or {}).get(self.last)
        return steps[row - 1] if steps is not None and row - 1 < steps.shape[0] else None

    def head(self, k: int, where: str, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        x = self._input(k, where, row)
        if x is None:
            return None
        if self._weight is None:
            self._weight = self.reference.checkpoint.lm_head_weight()
        return tuple(self.reference.head_logits(x.float()[None], dtype, weight=self._weight)[0]
                     for dtype in (torch.float32, torch.bfloat16))

    def for_prompt(self, k: int, where: str):
        """The per-row callable the tokens' judge takes (tokens.compare_logits, classify_departure)."""
        return lambda row: self.head(k, where, row)
