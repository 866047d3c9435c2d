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
3. each of the port's choices is decided on the port's own path (tokens.own_path_choice, the one
   rule tokens use too): transformers' own router alone, in fp32 and bf16, fed the very rows the
   port's router had (its `layers.{i}.attn_residual`; harness/parity/own_path.py computes them).
   The same choice as transformers' bf16 (or fp32) router there passes; another passes only while
   its fp32 margin there (the best expert it left out minus the worst it took) is within
   DECISION_HEADROOM x what bf16 moved that very margin, at least NEAR_TIE_ULPS bf16 ULPs of the
   largest router logit; else it is a routing divergence, which fails the stage at
   `layers.{i}.expert_weights` (part: moe router). A router that computes something else (skips
   the best expert, scores with other weights) departs from transformers on the same input by more
   than rounding: it cannot pass. Where no own path is at hand (quality's corpus, the drafter's
   clusters) a choice off the fp32 top-k is judged by the tail band instead: ROUTING_FACTOR x the
   largest (ROUTING_QUANTILE) move bf16 makes of the top-k boundary margin (tokens.calibrate_band).

Steps 1 and 2 are harness/parity/observe.py's (observe_stage follows the port's path, by the rule of
harness/parity/forced_path.py); step 3 is the stage judge's (harness/judge/stage.py calls judge_routing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from harness.base.points import Point
from harness.judge.compare import ROUTING_FACTOR, ROUTING_QUANTILE
from harness.judge.tokens import calibrate_band, margin_shifts, own_path_choice, tie_threshold
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
    evidence: str = ""


@dataclass
class RoutingResult:
    decisions: int
    band: float
    samples: int
    shift_at_quantile: float
    rerouted: list[str] = field(default_factory=list)  # the references computed again on the port's routing
    flips: list[RoutingChoice] = field(default_factory=list)
    own_path: bool = False  # decided on the port's own path (else by the tail band)

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
        rule = ("decided on the port's own path (transformers' router alone on the port's input)" if self.own_path
                else f"band {self.band:.4g} = {ROUTING_FACTOR:g} x the largest ({self.shift_at_quantile:.4g}) of bf16's "
                     f"top-k boundary margin shifts over {self.samples} decisions")
        return (f"routing: {self.decisions} router decisions, {len(self.flips)} differ from the fp32 top-k "
                f"({len(self.flips) - len(self.divergences)} accounted, {len(self.divergences)} divergences); "
                f"{rule}{again}")

    def failures(self, stage: str) -> list[dict]:
        return [{"stage": stage, "point": f.point, "where": f.where,
                 "detail": f"routes to experts {f.port_experts} where the fp32 top-k is {f.reference_experts}: "
                           + (f.evidence or f"margin {f.margin:.4g} above the routing band {f.threshold:.4g}")}
                for f in self.divergences]

    def to_json(self) -> dict:
        return {"passed": self.passed, "summary": self.describe(), "decisions": self.decisions, "band": self.band, "samples": self.samples,
                "shift_at_quantile": self.shift_at_quantile, "rerouted": self.rerouted,
                "flips": [asdict(f) for f in self.flips]}


# ---- the port's routing -------------------------------------------------------------------------

def port_rows(run, name: str) -> torch.Tensor | None:
    """A layer point of the port's teacher-forced run (harness.parity.observation.PortPrompt) at every
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
    """Every router decision of a stage's observation (harness.parity.observation.StageObservation):
    on the port's own path where obs.alone_routers holds transformers' router alone on the port's
    input (fp32, bf16) per router point; else against the fp32 logits (obs.ref, on the port's
    routing) by the tail band calibrated from obs.env."""
    alone = getattr(obs, "alone_routers", None) or {}
    names = _router_names(spec, obs)
    own = bool(names) and all(lg in alone for lg, _ in names)
    decisions = [RouterDecisions(w, obs.dev[w], *(alone[lg] if own else (obs.ref[lg], obs.env[lg])))
                 for lg, w in names]
    return judge_decisions(decisions, spec.moe.top_k, obs.label, obs.rerouted, own_path=own)


def judge_decisions(decisions: list[RouterDecisions], top_k: int, label, rerouted: list[str] = (),
                    own_path: bool = False) -> RoutingResult:
    """Each router point's decisions judged; label(name, row) names a row. own_path: each
    decision's logits are transformers' router alone on the port's input, and the one own-path rule
    decides (tokens.own_path_choice); else the tail band, the judge's one calibration
    (tokens.calibrate_band) over every decision's boundary shift, with its one tie helper
    (tokens.tie_threshold)."""
    calibration = calibrate_band([boundary_shifts(d.ref_logits, d.env_logits, top_k) for d in decisions],
                                 ROUTING_QUANTILE, ROUTING_FACTOR)
    result = RoutingResult(decisions=sum(d.ref_logits.shape[0] for d in decisions), band=calibration.band,
                           samples=calibration.samples, shift_at_quantile=calibration.shift_at_quantile,
                           rerouted=list(rerouted), own_path=own_path)
    for name, weights, ref, env in decisions:
        port, own = chosen_experts(weights, top_k), ref.topk(top_k, dim=-1).indices
        for row in range(ref.shape[0]):
            p, r = set(port[row].tolist()), set(own[row].tolist())
            if p == r:
                continue
            if own_path:
                inside, margin, threshold, evidence = own_path_choice(p, ref[row], env[row], top_k)
            else:
                margin, threshold, evidence = _swap_margin(ref[row].double(), p, r), tie_threshold(result.band, ref[row]), ""
                inside = margin <= threshold
            result.flips.append(RoutingChoice(
                point=name, where=label(name, row), port_experts=sorted(p), reference_experts=sorted(r),
                margin=margin, threshold=threshold, kind="near_tie" if inside else "divergence", evidence=evidence))
    return result
