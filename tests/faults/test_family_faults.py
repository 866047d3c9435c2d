"""The Gemma-4 family's faults (tests/faults/catalog.py FAMILY_CATALOG), each injected into the
port on its tiny transformers-built variant: `check` fails, at the expected capture point, layer and
part; the clean port passes the same check, both stages (on the MoE variant with routing
teacher-forced in the bf16 stage: harness/judge/routing.py)."""

from __future__ import annotations

import pytest

from tests.faults.catalog import FAMILY_CATALOG, TINY_MOE, Caught, run_family_check, unmet
from tests.family.shared import family_checkpoint, family_reference


def _variant(key: str) -> str:
    return key.removeprefix("tiny-")


@pytest.mark.slow  # the same clean ports pass check at TP 2 in tests/family/test_family_port.py
@pytest.mark.parametrize("key", ["tiny-e2b", "tiny-e4b", TINY_MOE, "tiny-unified-kv"])
def test_clean_family_port_passes(monkeypatch, key):
    ckpt, refs = family_checkpoint(_variant(key)), family_reference(_variant(key))
    result = run_family_check(None, monkeypatch, ckpt, refs)
    assert result.fp32.passed, result.fp32.failures()
    assert result.passed and result.bf16.divergences == 0, result.failures()
    if key == TINY_MOE:  # the tiny router's near ties do flip in bf16: the policy is exercised
        assert result.bf16.routing.flips and result.bf16.routing.passed, result.bf16.routing.describe()
        assert result.bf16.routing.rerouted, result.bf16.routing.describe()


# The default lane: check catches the per-layer-input, router and (gemma4_unified's) KV-sharing faults, bisect names the
# KV-sharing fault; the other part of each, the MoE MLP fault (check and bisect) and the rest of the
# catalog run in the slow lane, which CI runs too.
DEFAULT_LANE = {"ple-combine-factor", "router-skips-best-expert", "kv-shared-source-off-by-one-unified"}
DEFAULT_BISECT = {"shared-layer-writes-cache"}


def _lane(name: str, default=DEFAULT_LANE):
    return () if name in default else pytest.mark.slow


@pytest.mark.parametrize("fault", [pytest.param(f, id=f.name, marks=_lane(f.name)) for f in FAMILY_CATALOG])
def test_family_fault_is_caught_where_it_is(monkeypatch, fault):
    ckpt, refs = family_checkpoint(_variant(fault.checkpoint)), family_reference(_variant(fault.checkpoint))
    result = run_family_check(fault, monkeypatch, ckpt, refs)
    caught = Caught.of(result)
    assert not result.passed, fault.name
    missed = set(unmet(fault.expect, caught))
    assert result.fp32.divergent() == (fault.expect.first_layer, fault.expect.component), fault.name
    assert not missed, f"{fault.name}: misses {missed}; {caught}"


def test_family_catalog_covers_every_new_part():
    parts = {f.expect.component for f in FAMILY_CATALOG}
    assert {"attention", "mlp", "per-layer input", "moe router"} <= parts
    # 10 family faults and, since issue 45, the two KV-sharing faults on gemma4_unified's KV sharing
    assert len({f.name for f in FAMILY_CATALOG}) == len(FAMILY_CATALOG) == 12
    assert {f.name for f in FAMILY_CATALOG if f.checkpoint == "tiny-unified-kv"} == {
        "kv-shared-source-off-by-one-unified", "shared-layer-writes-cache-unified"}


# What bisect (capture mode) must name for every family fault: the layer and part of docs/faults.md's
# family fault table, the same as `check` (the catalog's Expectation). Each case is one bisect of a
# tiny variant (2-4 s).
BISECTED = {"ple-combine-factor": (0, "per-layer input"), "ple-table-unscaled": (0, "per-layer input"),
            "ple-wrong-layer-slice": (0, "per-layer input"), "kv-shared-source-off-by-one": (8, "attention"),
            "shared-layer-writes-cache": (5, "attention"), "moe-sum-without-norms": (0, "mlp"),
            "router-softmax-bf16": (0, "moe router"), "topk-not-renormalised": (0, "moe router"),
            "per-expert-scale-missing": (0, "moe router"), "router-skips-best-expert": (0, "moe router"),
            "kv-shared-source-off-by-one-unified": (8, "attention"), "shared-layer-writes-cache-unified": (5, "attention")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=_lane(n, DEFAULT_BISECT)) for n in BISECTED])
def test_bisect_names_the_family_fault(monkeypatch, name):
    """bisect (capture mode) names the layer and part, as `check` does: layers with per-layer inputs
    or shared KV by their cumulative points (they cannot run alone), a structural fault the bf16
    run shows only later (a shared layer writing its source's cache) by the fp32 stage's earlier
    point, the MoE layer by its local run."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.bisect import bisect_capture
    from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_KV_LEN

    fault = next(f for f in FAMILY_CATALOG if f.name == name)
    assert BISECTED[name] == (fault.expect.first_layer, fault.expect.component)
    ckpt, refs = family_checkpoint(_variant(fault.checkpoint)), family_reference(_variant(fault.checkpoint))
    fault.inject(monkeypatch)
    settings = RunSettings(tp=2, buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN)
    engine = build_engine(ckpt, settings, capture=True)
    result = bisect_capture(ckpt, engine, (refs["float32"], refs["bfloat16"]))
    assert (result.first_divergent_layer, result.component, result.cause) == (*BISECTED[name], "port")
    assert result.check.divergent() == BISECTED[name]  # the check it ran names the same (local verdicts on)
