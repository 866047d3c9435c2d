"""The routing policy of the bf16 stage on MoE models: routing is teacher-forced, as tokens are.

bf16 moves a router's logits by its rounding noise, so where two experts' logits nearly tie the
port may route a token to the other one, legitimately: the reference computed in bf16 does the
same. A whole expert's output then differs at that position, and from there on through the
residual stream and attention, far beyond any envelope. So, as a near-tied token flip is judged by
the margin and then the references are teacher-forced on the fp32 tokens:

1. the port's routing is read from its captures (`layers.{i}.expert_weights`: the chosen experts'
   weights, zero elsewhere) at every position it computed, prefill and teacher-forced decode;
2. where it differs from the references' routing, the references are computed again with their
   routers forced to the port's choices (harness.reference.run.rerun_reference), so every point
   compares the port with fp32 and bf16 along the same path;
3. each of the port's choices is judged against the fp32 reference's router logits on that path:
   a choice that differs from the fp32 top-k is a near tie when the fp32 margin of the swap (the
   best expert it left out minus the worst it took) is within the routing band, ROUTING_FACTOR x
   the ROUTING_QUANTILE of how far bf16 moves the fp32 top-k boundary margin (both references
   along the same path), at least NEAR_TIE_ULPS bf16 ULPs of the largest router logit; else it is
   a routing divergence, which fails the stage at `layers.{i}.expert_weights` (part: moe router).
   The band and the tie are the judge's one calibration and tie helper (tokens.calibrate_band,
   tokens.tie_threshold), as tokens' are.

Steps 1 and 2 are harness/parity/observe.py's (observe_stage follows the port's path, by the rule of
harness/parity/forced_path.py); step 3 is the stage judge's (harness/judge/stage.py calls judge_routing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from harness.base.points import Point
from harness.judge.compare import ROUTING_FACTOR, ROUTING_QUANTILE
from harness.judge.tokens import calibrate_band, margin_shifts, tie_threshold
from harness.reference.forcing import chosen_experts


@dataclass
class RoutingChoice:
    """One position where the port routed differently from the fp32 reference's logits."""

    point: str  # layers.{i}.expert_weights or decode.layers.{i}.expert_weights
    where: str
    port_experts: list[int]
    reference_experts: list[int]
    margin: float
    threshold: float
    kind: str  # near_tie | divergence


@dataclass
class RoutingResult:
    decisions: int
    band: float
    samples: int
    shift_at_quantile: float
    rerouted: list[str] = field(default_factory=list)  # the references computed again on the port's routing
    flips: list[RoutingChoice] = field(default_factory=list)

    @property
    def divergences(self) -> list[RoutingChoice]:
        return [f for f in self.flips if f.kind == "divergence"]

    @property
    def passed(self) -> bool:
        return not self.divergences

    def diverges_at(self, name: str) -> bool:
        return any(f.point == name for f in self.divergences)

    def describe(self) -> str:
        again = f"; references re-routed along the port's routing: {', '.join(self.rerouted)}" if self.rerouted else ""
        return (f"routing: {self.decisions} router decisions, {len(self.flips)} differ from the fp32 reference's "
                f"top-k ({len(self.flips) - len(self.divergences)} near ties, {len(self.divergences)} divergences); "
                f"band {self.band:.4g} = {ROUTING_FACTOR:g} x the {ROUTING_QUANTILE:g} quantile ({self.shift_at_quantile:.4g}) "
                f"of bf16's top-k boundary margin shifts over {self.samples} decisions{again}")

    def failures(self, stage: str) -> list[dict]:
        return [{"stage": stage, "point": f.point, "where": f.where,
                 "detail": f"routes to experts {f.port_experts} where the fp32 reference's top-k is "
                           f"{f.reference_experts}: margin {f.margin:.4g} above the routing band {f.threshold:.4g}"}
                for f in self.divergences]

    def to_json(self) -> dict:
        return {"passed": self.passed, "summary": self.describe(), "decisions": self.decisions, "band": self.band, "samples": self.samples,
                "shift_at_quantile": self.shift_at_quantile, "rerouted": self.rerouted,
                "flips": [asdict(f) for f in self.flips]}


# ---- the port's routing -------------------------------------------------------------------------

def port_rows(run, name: str) -> torch.Tensor | None:
    """A layer point of the port's teacher-forced run (harness.parity.observe.PortPrompt) at every
    position: the prefill rows, then each decode step's; None when the run has no such point."""
    rows = run.forced.prefill.captures.get(name)
    if rows is None:
        return None
    steps = (run.forced.step_captures or {}).get(name)
    return rows.float() if steps is None else torch.cat([rows.float(), steps.float()])


# ---- judging the port's choices ------------------------------------------------------------------

def boundary_shifts(ref: torch.Tensor, env: torch.Tensor, top_k: int) -> torch.Tensor:
    """|bf16 - fp32| of each row's top-k boundary margin (the fp32 k-th expert's logit minus the
    best left out's), both references' logits [rows, experts] along the same routing; empty when
    every expert is chosen (no boundary, no choice to judge)."""
    return margin_shifts(ref, env, competitors=1, rank=top_k)


def _swap_margin(logits: torch.Tensor, port: set, reference: set) -> float:
    """The fp32 logit of the best expert the port left out minus the worst it took instead."""
    return float(logits[sorted(reference - port)].max() - logits[sorted(port - reference)].min())


def _router_names(spec, obs) -> list[tuple[str, str]]:
    names = []
    for layer in spec.layers:
        for decode in (False, True):
            logits = Point("layer", layer.index, "router_logits", decode).name
            if logits in obs.dev:
                names.append((logits, Point("layer", layer.index, "expert_weights", decode).name))
    return names


class RouterDecisions(NamedTuple):
    """One router point's decisions: the expert-weights point's name, the port's expert weights,
    and the fp32 and bf16 references' router logits [rows, experts] on the port's routing."""

    point: str
    weights: torch.Tensor
    ref_logits: torch.Tensor
    env_logits: torch.Tensor


def judge_routing(obs, spec) -> RoutingResult:
    """Every router decision of a stage's observation (harness.parity.observe.StageObservation) judged
    against the fp32 logits (obs.ref, on the port's routing), the band calibrated from obs.env."""
    decisions = [RouterDecisions(w, obs.dev[w], obs.ref[lg], obs.env[lg]) for lg, w in _router_names(spec, obs)]
    return judge_decisions(decisions, spec.moe.top_k, obs.label, obs.rerouted)


def judge_decisions(decisions: list[RouterDecisions], top_k: int, label, rerouted: list[str] = ()) -> RoutingResult:
    """Each router point's decisions judged; label(name, row) names a row. The band is the judge's
    one calibration (tokens.calibrate_band) over every decision's boundary shift, the tie its one
    tie helper (tokens.tie_threshold)."""
    calibration = calibrate_band([boundary_shifts(d.ref_logits, d.env_logits, top_k) for d in decisions],
                                 ROUTING_QUANTILE, ROUTING_FACTOR)
    result = RoutingResult(decisions=sum(d.ref_logits.shape[0] for d in decisions), band=calibration.band,
                           samples=calibration.samples, shift_at_quantile=calibration.shift_at_quantile,
                           rerouted=list(rerouted))
    for name, weights, ref, _ in decisions:
        port, own = chosen_experts(weights, top_k), ref.topk(top_k, dim=-1).indices
        for row in range(ref.shape[0]):
            p, r = set(port[row].tolist()), set(own[row].tolist())
            if p == r:
                continue
            margin = _swap_margin(ref[row].double(), p, r)
            threshold = tie_threshold(result.band, ref[row])
            result.flips.append(RoutingChoice(
                point=name, where=label(name, row), port_experts=sorted(p), reference_experts=sorted(r),
                margin=margin, threshold=threshold, kind="near_tie" if margin <= threshold else "divergence"))
    return result
