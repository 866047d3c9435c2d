"""The routing policy's numbers (harness/judge/routing.py), pinned with hand-made router logits: where
no own path is at hand the tail band is ROUTING_FACTOR x the largest (ROUTING_QUANTILE 1) of the
top-k boundary margin shifts, at least
NEAR_TIE_ULPS bf16 ULPs; a choice off the fp32 top-k is a near tie when the swap's fp32 margin is
within it, else a divergence. Each planted judge bug (wrong quantile, factor, boundary, margin
sign, floor) fails one of these."""

from __future__ import annotations

import torch

from harness.reference.forcing import chosen_experts
from harness.judge.routing import (ROUTING_FACTOR, ROUTING_QUANTILE, RouterDecisions, RoutingResult, boundary_shifts,
                                   judge_decisions)


def _dense(chosen: list[list[int]], experts: int = 4) -> torch.Tensor:
    """Expert weights as the port captures them: the chosen experts' weights, zero elsewhere."""
    out = torch.zeros(len(chosen), experts)
    for row, ids in enumerate(chosen):
        out[row, ids] = torch.tensor([0.6, 0.4][:len(ids)])
    return out


def _label(name, row):
    return f"{name} row {row}"


def test_constants_are_the_documented_ones():
    assert (ROUTING_QUANTILE, ROUTING_FACTOR) == (1.0, 1.5)  # the tail, with 1.5x headroom (issue 45)


def test_boundary_shift_is_the_kth_against_the_next():
    ref = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    env = torch.tensor([[3.0, 2.5, 1.1, 0.0]])
    # k=2: the 2nd expert (2.0) against the 3rd (1.0): fp32 margin 1.0, bf16 margin 1.4
    assert torch.allclose(boundary_shifts(ref, env, 2), torch.tensor([0.4], dtype=torch.double))
    # k=1: the 1st (3.0) against the 2nd (2.0): 1.0 -> 0.5
    assert torch.allclose(boundary_shifts(ref, env, 1), torch.tensor([0.5], dtype=torch.double))


def test_chosen_experts_reads_the_nonzero_weights():
    weights = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.2, 0.0, 0.8, 0.0]])
    assert chosen_experts(weights, 2).tolist() == [[1, 3], [0, 2]]


def _rows(n: int, near: float):
    """n rows of fp32 logits whose k=2 boundary margin is 0.4 (row 0: `near`), each moved by bf16
    (env) by 0.05 at the 2nd expert: every boundary shift is 0.05, the band 0.075."""
    ref = torch.tensor([[1.0, 0.9, 0.5, 0.0]]).repeat(n, 1)
    ref[0, 2] = 0.9 - near
    env = ref.clone()
    env[:, 1] += 0.05
    return ref, env


def test_near_tie_and_divergence_by_the_band():
    ref, env = _rows(4, near=0.07)
    port = _dense([[0, 2], [0, 1], [0, 2], [0, 1]])  # row 0 swaps at margin 0.07, row 2 at 0.4
    result = judge_decisions([RouterDecisions("layers.0.expert_weights", port, ref, env)], 2, _label)
    assert abs(result.band - 0.075) < 1e-6 and result.samples == 4 and result.decisions == 4
    kinds = [(f.where, f.kind, round(f.margin, 4)) for f in result.flips]
    assert kinds == [("layers.0.expert_weights row 0", "near_tie", 0.07),
                     ("layers.0.expert_weights row 2", "divergence", 0.4)]
    assert not result.passed and result.diverges_at("layers.0.expert_weights")
    assert not result.diverges_at("layers.1.expert_weights")
    failure = result.failures("bf16")[0]
    assert failure["point"] == "layers.0.expert_weights" and "[0, 2]" in failure["detail"] and "[0, 1]" in failure["detail"]


def test_band_is_the_largest_shift_with_its_headroom():
    n = 100
    ref = torch.tensor([[1.0, 0.9, 0.5, 0.0]]).repeat(n, 1)
    env = ref.clone()
    env[:, 1] += torch.linspace(0.01, 1.0, n)  # shifts 0.01 .. 1.00
    port = _dense([[0, 1]] * n)
    result = judge_decisions([RouterDecisions("layers.0.expert_weights", port, ref, env)], 2, _label)
    expected = 1.5 * 1.0  # the largest shift (1.00), not a quantile of them
    assert abs(result.band - expected) < 1e-6 and result.passed and not result.flips


def test_ulp_floor_when_bf16_does_not_move_the_boundary():
    ref, _ = _rows(2, near=0.02)
    port = _dense([[0, 2], [0, 1]])
    result = judge_decisions([RouterDecisions("layers.0.expert_weights", port, ref, ref.clone())], 2, _label)
    assert result.band == 0.0
    flip = result.flips[0]
    # 4 bf16 ULPs at the largest logit 1.0: 4 * 2^-7 = 0.03125 >= 0.02
    assert flip.kind == "near_tie" and abs(flip.threshold - 0.03125) < 1e-9


def test_swap_margin_takes_the_worst_swap():
    ref = torch.tensor([[1.0, 0.9, 0.85, 0.1]])
    env = ref.clone()
    port = _dense([[2, 3]])  # left out 0 and 1 (best 1.0), took 2 and 3 (worst 0.1): margin 0.9
    result = judge_decisions([RouterDecisions("layers.0.expert_weights", port, ref, env)], 2, _label)
    assert abs(result.flips[0].margin - 0.9) < 1e-6 and result.flips[0].kind == "divergence"


def test_the_forcing_rule_joins_the_ports_prefill_and_decode_rows():
    """observe's references follow the port's routes read by the one forcing rule (follow_routes)."""
    from harness.parity.forced_path import follow_routing

    class Run:
        pass

    run = Run()
    run.forced = Run()
    run.forced.prefill = Run()
    run.forced.prefill.captures = {"layers.1.expert_weights": _dense([[0, 1], [2, 3]]),
                                   "layers.1.output": torch.zeros(2, 4)}
    run.forced.step_captures = {"layers.1.expert_weights": _dense([[1, 2]])}
    moe = type("Spec", (), {"moe": type("Moe", (), {"top_k": 2})()})()
    routes = follow_routing([run], moe, "bf16")[0].routes
    assert list(routes) == [1] and routes[1].tolist() == [[0, 1], [2, 3], [1, 2]]
    assert not follow_routing([run], moe, "fp32")[0].routes  # the fp32 stage follows nothing


def test_result_json_names_its_numbers():
    result = RoutingResult(decisions=3, band=0.1, samples=3, shift_at_quantile=0.05, rerouted=["float32"])
    payload = result.to_json()
    assert payload["passed"] and payload["rerouted"] == ["float32"] and "3 router decisions" in payload["summary"]
