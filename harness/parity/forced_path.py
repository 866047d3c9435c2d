"""The judge's rules for the references' path: which steps bf16 legitimately decides otherwise
than fp32, so that the references are computed again along the port's choice there, as they are
teacher-forced on the fp32 tokens (harness/reference/forcing.py forces them):

- routing (`follow_routing`): on MoE models the references follow the port's experts wherever it
  routed otherwise (a near-tied router choice puts a whole expert's output into the residual
  stream); each choice is then judged by the routing band (harness/judge/routing.py, in the stage judge);
- pins (`add_pins`): a gated per-layer input row (PLE models) without a direction at bf16
  precision takes the port's value (the layer's post-norm scales that direction up to full size).

harness/parity/observe.py (observe_stage) applies these rules while it observes a stage; nothing else
re-runs the references.
"""

from __future__ import annotations

import torch

from harness.base.points import Point
from harness.judge.compare import PLE_PIN_NOISE
from harness.judge.routing import port_rows
from harness.reference.forcing import Forced, follow_routes, routes_of, rows_by_position


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)


def _noise_scale(refs: list[tuple]) -> tuple[float, float]:
    """(median row norm, median absolute bf16 error) of one point over every prompt's rows."""
    ref = torch.cat([r for r, _ in refs])
    env = torch.cat([e for _, e in refs])
    return float(ref.norm(dim=-1).median()), float((env - ref).norm(dim=-1).median())


def _gate_noise(gate: torch.Tensor, inputs: list[tuple]) -> float:
    """The typical bf16 error of a per-layer gate's pre-activation: the median absolute value of
    the gate applied to the bf16 reference's error in its input (the layer's MLP residual)."""
    return float(torch.cat([((e - r) @ gate.T).abs().flatten() for r, e in inputs]).median())


def _expected_rel_error(ref_gated: torch.Tensor, pre: torch.Tensor, noise: tuple) -> torch.Tensor:
    """Each row's expected relative bf16 error of the gated per-layer input g = gelu(a) * p: the
    point's typical absolute error, plus each element's error from its gate's pre-activation
    moving by its typical noise (large in gelu's tail, where a small move of a changes gelu(a)
    by a large factor), over the row's norm."""
    typical, gate_noise = noise
    act = torch.nn.functional.gelu(pre, approximate="tanh")
    moved = torch.nn.functional.gelu(pre + gate_noise, approximate="tanh")
    p = torch.where(act.abs() > 0, ref_gated / act.where(act.abs() > 0, torch.ones_like(act)), torch.zeros_like(act))
    from_gate = ((moved - act) * p).norm(dim=-1)
    return (typical + from_gate) / ref_gated.norm(dim=-1).clamp_min(1e-30)


def add_pins(obs, checkpoint, forcing: list[Forced]) -> list[str]:
    """Pin (force the references to the port's value at) every gated per-layer input row without
    a direction at bf16 precision: its expected bf16 error (_expected_rel_error: rows that nearly
    cancel, elements deep in the gate's tail) is at least PLE_PIN_NOISE of the fp32 row. The
    layer's post-norm scales that direction up to full size. The rule reads the fp32 reference and
    the typical noise of the point only, never one row's error sample: pinning where the bf16
    reference happened to err would leave the port's unlucky rows beside an envelope cut short.
    obs: a harness.parity.observation.StageObservation. Returns the new pins' labels."""
    added, spec = [], checkpoint.spec
    for layer in spec.layers:
        name = Point("layer", layer.index, "per_layer_input").name
        mlp = Point("layer", layer.index, "mlp_residual").name
        rows = [(port_rows(run, name), rows_by_position(r32.captures, name), rows_by_position(r16.captures, name),
                 rows_by_position(r32.captures, mlp), rows_by_position(r16.captures, mlp))
                for run, r32, r16 in zip(obs.runs, obs.ref32, obs.ref16)]
        if not rows or any(any(t is None for t in row) or row[0].shape != row[1].shape for row in rows):
            continue
        gate = checkpoint.layer_weights(layer.index, torch.float32)["per_layer_input_gate.weight"]
        median_norm, typical = _noise_scale([(r, e) for _, r, e, _, _ in rows])
        gate_noise = _gate_noise(gate, [(m32, m16) for *_, m32, m16 in rows])
        for k, (dev, ref, _, m32, _) in enumerate(rows):
            expected = _expected_rel_error(ref, m32 @ gate.T, (typical, gate_noise))
            pins = forcing[k].inputs.setdefault(layer.index, {})
            for position in (expected >= PLE_PIN_NOISE).nonzero().flatten().tolist():
                if position not in pins:
                    pins[position] = dev[position].clone()
                    added.append(f"layer {layer.index} prompt {k} position {position}")
    return added


def seed_pins(forcing: list[Forced], pins: list | None, runs: list) -> list[str]:
    """Start `forcing` from pins the references already hold (per prompt layer -> position -> value:
    the batch stage starts from the bf16 stage's); where this run's value differs, the pin takes
    it (returned: the references must then run again). A run sharing every value runs none again."""
    changed = []
    for k, (forced, seeded, run) in enumerate(zip(forcing, pins or [], runs)):
        for layer, rows in seeded.items():
            dev = port_rows(run, Point("layer", layer, "per_layer_input").name)
            mine = forced.inputs.setdefault(layer, {})
            for position, value in rows.items():
                same = dev is not None and position < dev.shape[0] and torch.equal(value, dev[position])
                mine[position] = value if same or dev is None else dev[position].clone()
                changed += [] if same else [f"layer {layer} prompt {k} position {position}"]
    return changed


def follow_routing(runs: list, spec, stage: str) -> list[Forced]:
    """The routing rule: per prompt, what its references are forced to before any pin: in the bf16
    stage of an MoE model the port's experts at every position it computed (harness.parity.observation.PortPrompt
    runs); nothing in the fp32 stage, where the port must route as the fp32 reference does."""
    if spec.moe is None or stage != "bf16":
        return [Forced() for _ in runs]
    return [follow_routes(_port_captures(run), spec.moe.top_k) for run in runs]


def _port_captures(run) -> dict:
    """One prompt's teacher-forced port run as a reference's captures: the prefill's points, then
    each decode step's under `decode.`."""
    forced = run.forced
    return {**forced.prefill.captures, **{"decode." + k: v for k, v in (forced.step_captures or {}).items()}}


def routes_differ(forcing: list[Forced], references: list, spec) -> bool:
    """Whether some prompt's references routed otherwise than they are to be forced."""
    return any(f.routes and not _same(f.routes, routes_of(r, spec.moe.top_k)) for f, r in zip(forcing, references))
