"""Routing teacher-forced (harness/reference/run.py force_routing, harness/judge/routing.py) on the tiny
transformers-built 26B-A4B shape: the bf16 reference follows the fp32 routing, a re-run on a run's
own routing is bit for bit that run, a re-run on other routing takes it, and the local verdicts of
MoE layers judge the routing of each layer alone."""

from __future__ import annotations

import pytest
import torch

from harness.reference.forcing import Forced, routes_of
from harness.reference.run import rerun_reference
from tests.family.shared import family_checkpoint, family_reference

MOE = "26b-a4b"


def _top_k():
    return family_checkpoint(MOE).spec.moe.top_k


def test_bf16_reference_routes_as_fp32_does():
    refs, k = family_reference(MOE), _top_k()
    for r32, r16 in zip(refs["float32"], refs["bfloat16"]):
        a, b = routes_of(r32, k), routes_of(r16, k)
        assert a and a.keys() == b.keys()
        assert all(torch.equal(a[i], b[i]) for i in a)
        assert a[0].shape[0] == len(r32.prompt) + len(r32.generated) - 1  # prefill rows, then decode steps


def test_rerun_on_own_routing_is_the_same_run_and_other_routing_is_taken():
    refs, k, ckpt = family_reference(MOE), _top_k(), family_checkpoint(MOE)
    r32 = refs["float32"][:2]
    fed = [r.generated for r in r32]
    same = rerun_reference(ckpt.path, "float32", fed, (r32, [Forced(routes=routes_of(r, k)) for r in r32]))
    for a, b in zip(r32, same):
        assert a.captures.keys() == b.captures.keys() and a.generated == b.generated
        assert all(torch.equal(a.captures[n], b.captures[n]) for n in a.captures)
    other = []
    for r in r32:
        routes = routes_of(r, k)
        moved = routes[2].clone()
        moved[5:] = (moved[5:] + 1) % ckpt.spec.moe.num_experts  # layer 2 from position 5 on
        other.append(Forced(routes={**routes, 2: moved.sort(dim=-1).values}))
    again = rerun_reference(ckpt.path, "float32", fed, (r32, other))
    for a, b, want in zip(r32, again, other):
        assert torch.equal(routes_of(b, k)[2][:len(a.prompt)], want.routes[2][:len(a.prompt)])
        assert b.generated == a.generated  # the fp32 tokens the port is judged on stay
        before, after = a.captures["layers.2.mlp_residual"], b.captures["layers.2.mlp_residual"]
        # rows before 5 keep their experts (fp32 rounding of a differently batched matmul aside)
        assert torch.allclose(before[:5], after[:5], rtol=1e-5, atol=1e-5)
        assert (before[5:] - after[5:]).abs().max() > 1e-2
        assert torch.equal(a.captures["layers.1.output"], b.captures["layers.1.output"])


@pytest.mark.slow  # about 10 CPU-seconds; the stage's routing judge runs in the default lane (family faults)
def test_local_verdicts_follow_each_layers_own_routing(monkeypatch):
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port
    from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_CATALOG, FAMILY_KV_LEN

    refs, ckpt = family_reference(MOE), family_checkpoint(MOE)
    settings = RunSettings(tp=2, buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN)
    clean = check_port(ckpt, build_engine(ckpt, settings, capture=True), refs["float32"], refs["bfloat16"],
                       local=True, fp32_engine=None)
    assert clean.passed and all(v.passed for v in clean.bf16.local_verdicts), clean.failures()
    assert all(v.routing is not None and v.routing.passed for v in clean.bf16.local_verdicts)
    fault = next(f for f in FAMILY_CATALOG if f.name == "router-skips-best-expert")
    fault.inject(monkeypatch)
    bad = check_port(ckpt, build_engine(ckpt, settings, capture=True), refs["float32"], refs["bfloat16"],
                     local=True, fp32_engine=None)
    first = next(v for v in bad.bf16.local_verdicts if not v.passed)
    assert (first.index, first.component) == (0, "moe router") and not first.routing.passed
    assert bad.divergent() == (0, "moe router")
