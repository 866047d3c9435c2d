"""The departure rule decided on the port's own path (tokens.own_path_choice, issue 45): the same
choice as transformers' bf16 computation of that decision on the port's input passes; another choice
passes only inside what bf16 moves that very margin (with the stated headroom); outside it fails. A
router or head that computes something else fails on any input."""

from __future__ import annotations

import torch

from harness.judge.compare import DECISION_HEADROOM
from harness.judge.routing import RouterDecisions, judge_decisions
from harness.judge.tokens import classify_mismatch, own_path_choice


def test_the_three_outcomes_of_a_token():
    ref_row = torch.tensor([10.0, 9.0, 0.0])  # the reference (its own path) prefers token 0 by 1.0
    # 1. transformers' bf16 head, fed the port's input, chooses the port's token 1 too
    same = classify_mismatch(0, ref_row, 1, band=0.0, alone=(torch.tensor([5.0, 5.01, 0.0]),
                                                             torch.tensor([5.0, 5.02, 0.0])))
    assert same.kind == "near_tie" and "same choice" in same.evidence
    # 2. a different choice, but its fp32 margin (0.01) is inside 4x what bf16 moved it (0.02: 0.08)
    alone32, alone16 = torch.tensor([0.51, 0.50, 0.0]), torch.tensor([0.53, 0.50, 0.0])
    inside = classify_mismatch(0, ref_row, 1, band=0.0, alone=(alone32, alone16))
    assert inside.kind == "near_tie" and abs(inside.margin - 0.01) < 1e-6 and abs(inside.threshold - 0.08) < 1e-6
    # 3. a different choice far outside what bf16 moves it on the same input: a divergence, whatever the band
    outside = classify_mismatch(0, ref_row, 1, band=100.0, alone=(torch.tensor([6.0, 5.0, 0.0]),
                                                                  torch.tensor([6.0, 5.0, 0.0])))
    assert outside.kind == "divergence" and outside.margin == 1.0
    # without an own path, the tail band decides (the served build, replays)
    assert classify_mismatch(0, ref_row, 1, band=1.5).kind == "near_tie"
    assert classify_mismatch(0, ref_row, 1, band=0.5).kind == "divergence"


def test_the_headroom_is_what_bf16_moves_that_very_margin():
    moved = 0.25  # bf16 moves the margin 1.0 -> 0.75 on the port's input
    a32, a16 = torch.tensor([1.0, 0.0]), torch.tensor([0.75, 0.0])
    accounted, margin, threshold, _ = own_path_choice({1}, a32, a16)
    assert margin == 1.0 and threshold == DECISION_HEADROOM * moved and accounted
    a16 = torch.tensor([0.9375, 0.0])  # moved 0.0625: the margin 1.0 is 16x the move, past the headroom
    assert not own_path_choice({1}, a32, a16)[0]


def test_a_structural_flip_is_never_excused_by_the_own_path():
    alone = (torch.tensor([5.0, 5.01]), torch.tensor([5.0, 5.01]))
    assert classify_mismatch(0, torch.tensor([10.0, 9.0]), 1, structural=True, alone=alone).kind == "divergence"


def _router(rows: int = 16, experts: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, experts, generator=gen) * 2


def _weights(choice: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(choice.shape[0], experts).scatter(-1, choice, 0.5)


def test_routing_on_the_own_path_accounts_bf16s_choice_and_fails_a_wrong_router():
    t32 = _router()
    t16 = t32.bfloat16().float()
    # the port computes transformers' bf16 router on its input: it chooses what t16 chooses
    port = _weights(t16.topk(2).indices, 8)
    healthy = judge_decisions([RouterDecisions("layers.0.expert_weights", port, t32, t16)], 2,
                              lambda n, r: f"row {r}", own_path=True)
    assert healthy.passed and healthy.own_path
    # a router that skips the best expert (the fault catalog's router-skips-best-expert)
    skip = _weights(t32.topk(3).indices[:, 1:], 8)
    faulty = judge_decisions([RouterDecisions("layers.0.expert_weights", skip, t32, t16)], 2,
                             lambda n, r: f"row {r}", own_path=True)
    assert not faulty.passed and len(faulty.divergences) == 16
    assert "on the port's own input" in faulty.failures("bf16")[0]["detail"]
