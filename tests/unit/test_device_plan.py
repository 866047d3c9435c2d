"""The device plan's MoE rule and working set (harness/device_plan.py) against what the MoE block
really allocates, and the two expert paths against each other."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.device_plan import EXPERT_BLOCK, moe_gathers, moe_working_set_bytes
from harness.model import Collectives
from harness.model_blocks import Experts
from harness.spec import load_spec
from harness import FIXTURES_DIR

CONFIGS = FIXTURES_DIR / "configs"


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _moe_spec():
    return load_spec(CONFIGS / "tiny" / "gemma-4-tiny-26b-a4b.json")


def _experts(spec, tp=1, seed=0):
    torch.manual_seed(seed)
    experts = Experts(spec, tp, Collectives())
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


def _routing(spec, tokens, seed=1):
    g = torch.Generator().manual_seed(seed)
    e, k = spec.moe.num_experts, spec.moe.top_k
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return weights / weights.sum(-1, keepdim=True), chosen


def test_the_rule_is_nxds_selective_loading_threshold():
    """Gather only where tokens x top-k < experts (NxD: perc_experts_loaded < 1.0)."""
    assert moe_gathers(1, 8, 128) and moe_gathers(15, 8, 128)
    assert not moe_gathers(16, 8, 128) and not moe_gathers(256, 8, 128)


@pytest.mark.parametrize("tokens", [1, 3, 4, 64])
def test_both_expert_paths_compute_the_same_sum(tokens):
    """fp32: the all-experts path (prefill) equals the gathered path on the same routing."""
    spec = _moe_spec()
    experts = _experts(spec)
    x = torch.randn(tokens, spec.hidden_size)
    weights, chosen = _routing(spec, tokens)
    gathered = experts.gathered(x, weights, chosen)
    dense = torch.zeros(tokens, spec.moe.num_experts).scatter(-1, chosen, weights)
    torch.testing.assert_close(experts.all_experts(x, dense), gathered, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts(x, weights, chosen), gathered, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_the_plan_counts_the_largest_tensor_the_block_allocates(tokens):
    """Prefill never materialises the chosen experts' weights per token ([t, k, 2m, h]); the plan's
    working set bounds the largest tensor the block allocates, whichever path runs."""
    spec = _moe_spec()
    experts = _experts(spec)
    x = torch.randn(tokens, spec.hidden_size)
    weights, chosen = _routing(spec, tokens)
    with LargestTensor() as seen:
        experts(x, weights, chosen)
    m, h, k = spec.moe.intermediate_size, spec.hidden_size, spec.moe.top_k
    planned = moe_working_set_bytes(spec, 1, tokens, 4)
    assert seen.largest <= planned
    if not moe_gathers(tokens, k, spec.moe.num_experts):
        assert seen.largest < tokens * k * 2 * m * h * 4  # the gathered gate/up weights never exist


def test_the_26b_a4b_prefill_working_set_fits_a_core_at_tp4():
    """The review's numbers: gathering for a 256 bucket at TP 4 is 5.67 GiB per layer; all experts
    in blocks is a small fraction of a GiB."""
    spec = load_spec(CONFIGS / "gemma-4-26b-a4b-it.json")
    gather = 256 * spec.moe.top_k * 3 * (spec.moe.intermediate_size // 4) * spec.hidden_size * 2
    assert round(gather / 2**30, 2) == 5.67
    assert moe_working_set_bytes(spec, 4, 256, 2) < 0.25 * 2**30
    assert moe_working_set_bytes(spec, 4, 1, 2) == 8 * 3 * 176 * 2816 * 2  # decode gathers k experts
    assert EXPERT_BLOCK < spec.moe.num_experts
