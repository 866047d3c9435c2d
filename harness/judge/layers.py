"""The verdict on one layer of the port alone on the reference's input (the local verdict) beside
its cumulative points: `LayerVerdict`, and `judge_layer_alone`, which judges the port's layer against
the golden by the local bf16 noise of transformers' own layer on the same input (harness/parity/local.py
runs the layers; harness/reference/layers.py runs transformers' layer)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch

from harness.base.points import first_component, layer_points
from harness.judge.compare import ENVELOPE_FACTOR, PointResult, compare_point, rel_l2
from harness.judge.verdicts import LayerResult
from harness.judge.routing import RouterDecisions, judge_decisions


def _finite_or_none(value):
    """JSON has no Infinity or NaN: a non-finite number is written as null (with `finite` beside it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def tensor_stats(t: torch.Tensor | None) -> dict | None:
    """Polygraphy-style summary of one side's values."""
    if t is None:
        return None
    t = t.double()
    finite = bool(torch.isfinite(t).all())
    return {"mean": float(t.mean()), "std": float(t.std()) if t.numel() > 1 else 0.0,
            "min": float(t.min()), "max": float(t.max()), "finite": finite}


def stack_prompts(runs: list[dict], name: str) -> torch.Tensor:
    """One capture point of every prompt, stacked along the position rows."""
    return torch.cat([r[name] for r in runs], dim=0)


@dataclass
class LayerVerdict:
    """One layer: cumulative points (the port's own run) and local points (the layer alone on the
    golden's input). Truncate mode fills only `cumulative`, with the points its builds read out
    (the output, and the attention residual of the first failing prefix)."""

    index: int
    type: str
    cumulative: list[PointResult]
    local: list[PointResult] = field(default_factory=list)
    # How far transformers' fp32 layer on this checkpoint is from the golden at this layer's output:
    # nonzero when the weights changed since the golden was written.
    checkpoint_drift_rel_l2: float | None = None
    # The port's local run judged against transformers on *this* checkpoint: passes when the port
    # computes today's weights right, so a local failure against the golden is a weight change.
    port_matches_checkpoint: bool | None = None
    stats: dict = field(default_factory=dict)
    routing: object = None  # an MoE layer alone: its router choices judged (harness.judge.routing)

    @property
    def judged(self) -> list[PointResult]:
        return self.local or self.cumulative

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.judged)

    @property
    def cumulative_passed(self) -> bool:
        return all(p.passed for p in self.cumulative)

    @property
    def component(self) -> str | None:
        """attention when the attention residual breaks the policy; mlp when only the MLP residual
        or the scaled output does (the attention half was fine on the same input)."""
        return first_component(self.judged)

    @property
    def finite(self) -> bool:
        return all(p.finite for p in self.cumulative + self.local)

    def to_json(self) -> dict:
        cum, loc = self.cumulative[-1], (self.local[-1] if self.local else None)
        out = {
            "index": self.index, "type": self.type,
            "cumulative_rel_l2": cum.rel_l2, "envelope_rel_l2": cum.envelope_rel_l2,
            "cumulative_ratio": max(p.required_factor for p in self.cumulative),
            "cumulative_pass": self.cumulative_passed,
            "local_rel_l2": loc.rel_l2 if loc else None,
            "local_envelope_rel_l2": loc.envelope_rel_l2 if loc else None,
            "local_ratio": max(p.required_factor for p in self.local) if self.local else None,
            "required_factor": max(p.required_factor for p in self.judged),
            "tolerance_factor": ENVELOPE_FACTOR,
            "pass": self.passed, "finite": self.finite, "component": self.component,
            "checkpoint_drift_rel_l2": self.checkpoint_drift_rel_l2,
            "port_matches_checkpoint": self.port_matches_checkpoint,
            "stats": self.stats,
            "cumulative_points": [asdict(p) for p in self.cumulative],
            "local_points": [asdict(p) for p in self.local],
        }
        return _finite_or_none(out)


class LayerRuns(NamedTuple):
    """One layer's capture points per prompt: the port's layer alone, the golden, and transformers'
    own layer in fp32 and bf16 on the same input."""

    port: list[dict]
    golden: list[dict]
    fp32: list[dict]
    bf16: list[dict]


def judge_layer_alone(spec, index: int, runs: LayerRuns, cumulative: LayerResult,
                      device_out: torch.Tensor) -> LayerVerdict:
    """Judge one layer's local run. The error is the port against the golden; the envelope is the
    bf16-vs-fp32 noise of transformers' layer on the same input, added to the golden's value so
    compare_point applies the same policy (floor, per-position ratio) as everywhere else. Using
    this checkpoint's own bf16 output as the envelope would hide a weight change in the envelope."""
    port, golden, ref32, ref16 = runs
    local, against_checkpoint = [], []
    for name in layer_points(index, spec=spec):
        dev, gold = stack_prompts(port, name), stack_prompts(golden, name)
        r32, r16 = stack_prompts(ref32, name), stack_prompts(ref16, name)
        local.append(compare_point(name, dev, gold, _shifted_envelope(gold, r32, r16)))
        against_checkpoint.append(compare_point(name, dev, r32, r16))
    out = f"layers.{index}.output"
    return LayerVerdict(
        index=index, type=spec.layers[index].type, cumulative=cumulative.points, local=local,
        checkpoint_drift_rel_l2=rel_l2(stack_prompts(ref32, out), stack_prompts(golden, out)),
        port_matches_checkpoint=all(p.passed for p in against_checkpoint),
        stats={"golden": tensor_stats(stack_prompts(golden, out)), "port_local": tensor_stats(stack_prompts(port, out)),
               "port_cumulative": tensor_stats(device_out)},
    )


def _shifted_envelope(golden: torch.Tensor, r32: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """The golden plus the bf16-vs-fp32 noise of transformers on this checkpoint: compare_point
    then judges the port against the golden by the local bf16 noise, with its usual floor and
    per-position ratio. This checkpoint's own bf16 output would carry any weight change into the
    envelope and hide it."""
    return golden + (r16 - r32)


def judge_local_routing(verdict: LayerVerdict, spec, runs: LayerRuns, alone: tuple | None = None) -> None:
    """An MoE layer alone: a router choice that departs fails its expert-weights point
    (harness/judge/routing.py judges it as the bf16 stage does: on the port's own path, `alone`:
    transformers' router alone on the port's router input, fp32 and bf16 logits; else against
    transformers' layer on the same input by the tail band)."""
    i, name = verdict.index, f"layers.{verdict.index}.expert_weights"
    logits = f"layers.{i}.router_logits"
    pair = alone if alone is not None else (stack_prompts(runs.fp32, logits), stack_prompts(runs.bf16, logits))
    routing = judge_decisions([RouterDecisions(name, stack_prompts(runs.port, name), *pair)],
                              spec.moe.top_k, lambda n, row: f"row {row}", own_path=alone is not None)
    verdict.routing = routing
    if not routing.passed:  # the port's choice against this checkpoint's own logits: the port's error
        verdict.local = [replace(p, passed=False) if p.name == name else p for p in verdict.local]
        verdict.port_matches_checkpoint = False
