"""The device plan's MoE rule and working set (harness/port/device_plan.py) against what the MoE block
really allocates, and the two expert paths against each other."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import FIXTURES_DIR
from harness.inputs.spec import load_spec
from harness.port.blocks import Experts
from harness.port.device_plan import EXPERT_BLOCK, moe_gathers, moe_working_set_bytes
from harness.port.model import Collectives

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


def test_the_fit_counts_graphs_moe_and_the_layout_transform():
    """The 26B-A4B at TP 4 fits by a plan that counts its prefill working set, its graphs and the
    least the layout transform's load holds; each term is in the total it is judged by."""
    from harness.plan.instances import CORE_HBM, core_bytes, placement
    from harness.port import core_fit
    from harness.port.core_fit import graphs_bytes
    from harness.port.device_plan import graph_kinds, graph_shapes
    from harness.port.sharding import bytes_per_rank

    spec = load_spec(CONFIGS / "gemma-4-26b-a4b-it.json")
    core = core_bytes(spec, 4, buckets=(64, 256))
    base = bytes_per_rank(spec, 4, "bfloat16", 256)
    graphs = graphs_bytes(spec, 4, graph_kinds((64, 256), 256), 2, capture=True)  # a parity build
    assert core["moe_working_set"] == moe_working_set_bytes(spec, 4, 256, 2) > 0
    assert core["run"] == base["total"] + graphs["graphs"] + core["moe_working_set"] + core_fit.RUNTIME_RESERVE_BYTES
    assert core["graphs"] == len(graph_shapes((64, 256), 256)) == 7  # decode at 3 KV buckets, 64 at 3, 256 at 1
    assert core["layout_most"] - core["layout_least"] == core["weights"] - 262144 // 4 * spec.hidden_size * 2
    assert core["weights"] < core["layout_least"] <= core["layout_most"] and core["total"] >= core["run"]
    assert placement(spec, 4, buckets=(64, 256))["fits"] and core["total"] <= CORE_HBM
    assert core_bytes(spec, 4, buckets=(64, 256), layout=False)["total"] == core["run"]


def test_a_run_that_fits_only_without_the_layout_transform_names_it(monkeypatch):
    from harness.base.errors import ShardingError
    from harness.plan import instances

    spec = load_spec(CONFIGS / "gemma-4-12b-it.json")
    core = instances.core_bytes(spec, 2)
    assert core["run"] < core["layout_least"]
    monkeypatch.setattr(instances, "CORE_HBM", (core["run"] + core["layout_least"]) // 2)
    with pytest.raises(ShardingError, match="layout_priority=none"):
        instances.check_fits(spec, 2, layout=True)  # --backend-option layout_priority=decode
    instances.check_fits(spec, 2)  # fits without the transform, the default


def test_kv_buckets_are_capped_and_still_cover_every_call():
    """At a 128K KV length the graphs stay few (a cap on KV buckets), the KV length is a bucket, and
    every bucket holds the smallest prefill bucket's first call."""
    from harness.port.device_plan import MAX_KV_BUCKETS, graph_shapes, kv_buckets

    for buckets, kv_len in [((64,), 131072), ((16, 64, 256), 4096), ((64, 256), 256), ((1024,), 65536)]:
        kv = kv_buckets(buckets, kv_len)
        assert len(kv) <= MAX_KV_BUCKETS and kv[-1] == kv_len and list(kv) == sorted(set(kv))
        assert kv[0] >= min(buckets) and kv[0] < 2 * max(16, min(buckets))
    assert len(graph_shapes((64,), 131072)) <= 2 * MAX_KV_BUCKETS  # was 34 graphs uncapped
    assert kv_buckets((64,), 256) == (64, 128, 256)  # few buckets: powers of two, as before


def test_a_speculative_build_counts_its_verify_graph_and_the_assistants_drafter(tiny0_dir, monkeypatch):
    """--speculate k adds the verify graph (k+1 positions) at each KV bucket that holds it, even where
    a prefill bucket has its length; the assistant adds its drafter's weights and one draft graph per
    KV bucket; a pair that fits only without the drafter is refused naming it."""
    import json

    from harness.base.errors import ShardingError
    from harness.inputs.assistant_spec import assistant_spec_from_dict
    from harness.plan import instances
    from harness.port import core_fit
    from harness.port.device_plan import graph_shapes, kv_buckets
    from harness.port.graphs import kv_graph_plan

    kvs = kv_buckets((16, 64), 256)
    plain = graph_shapes((16, 64), 256)
    assert sorted(graph_shapes((16, 64), 256, speculate=3)) == sorted(plain + [(4, kv) for kv in kvs])
    assert len(graph_shapes((16, 64), 256, speculate=15)) == len(plain) + len(kvs)  # verify_16 beside prefill_16
    for k in (0, 3, 15):  # the fit counts the graphs the build compiles
        assert sorted(graph_shapes((16, 64), 256, k)) == sorted((n, kv) for _, n, kv in kv_graph_plan((16, 64), 256, k))
    assert graph_shapes((16, 64), 256, drafts=True) == plain + [(1, kv) for kv in kvs]

    spec = load_spec(tiny0_dir)
    config = json.loads((FIXTURES_DIR / "configs" / "tiny" / "gemma-4-tiny-assistant.json").read_text())
    aspec = assistant_spec_from_dict(config, spec)
    alone = instances.core_bytes(spec, 2, buckets=(16, 64))
    pair = instances.core_bytes(spec, 2, buckets=(16, 64), speculate=3, assistant=aspec)
    drafter = aspec.bytes_per_rank(2, 2)
    assert pair["drafter"] == drafter > 0 and alone["drafter"] == 0
    assert pair["graphs"] == alone["graphs"] + 2 * len(kvs)  # verify and draft graphs at every KV bucket
    assert pair["run"] - alone["run"] == drafter + pair["graph_bytes"] - alone["graph_bytes"]
    # the layout transform's upper bound: a second copy of every weight, the drafter's too
    assert pair["layout_most"] - alone["layout_most"] == 2 * drafter + (pair["graphs"] - alone["graphs"]) * (
        core_fit.GRAPH_OVERHEAD_BYTES)
    monkeypatch.setattr(instances, "CORE_HBM", (alone["total"] + pair["total"]) // 2)
    instances.check_fits(spec, 2, buckets=(16, 64))
    with pytest.raises(ShardingError, match="drafter"):
        instances.check_fits(spec, 2, buckets=(16, 64), speculate=3, assistant=aspec)
