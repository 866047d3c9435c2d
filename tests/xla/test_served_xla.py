"""The served build on the XLA backend: the perf graphs (last real row only) are a different
build from the parity graphs; `check`'s served stage runs them as bench builds them, passes on the
healthy port, and fails naming the served build when only the perf graph is wrong."""

from __future__ import annotations

import pytest

from harness.base.settings import RunSettings
from harness.parity.served import check_served_build
from harness.reference.run import run_reference
from tests.parity import served_faults

pytestmark = pytest.mark.xla
PROMPTS = [[2, 17, 93, 41, 250, 8, 77], [2] + list(range(30, 53))]
BUCKETS, KV_LEN, NEW = (32,), 64, 3


@pytest.fixture(scope="module")
def refs(tiny0_dir):
    out = run_reference(tiny0_dir, PROMPTS, NEW)
    return out["float32"], out["bfloat16"]


def _served(ckpt, refs):
    return check_served_build(ckpt, *refs, None, settings=RunSettings(backend="xla", tp=2, dtype="bfloat16",
                                                                      buckets=BUCKETS, kv_len=KV_LEN))


def test_healthy_perf_graphs_pass_and_are_a_separate_build(tiny0_ckpt, refs):
    result = _served(tiny0_ckpt, refs)
    assert result.ran and result.last_row_only and not result.same_code
    assert result.passed, result.failures()
    # each prompt either matches the reference or departs at a tie the judge accounts for
    assert all(p.departure is None or p.departure.kind in ("near_tie", "saturation_tie") for p in result.prompts)
    assert any(p.tokens == r.generated for p, r in zip(result.prompts, refs[0]))


@pytest.mark.parametrize("fault", [served_faults.last_row_gather_off_by_one, served_faults.lm_head_slice_shifted],
                         ids=lambda f: f.__name__)
def test_a_fault_only_in_the_perf_graph_fails_naming_the_served_build(tiny0_ckpt, refs, monkeypatch, fault):
    fault(monkeypatch)
    result = _served(tiny0_ckpt, refs)
    assert result.ran and not result.passed
    failures = result.failures()
    assert failures and {f["stage"] for f in failures} == {"served"}
    assert failures[0]["point"].startswith("served build")
