"""The census through `quality` (issue 26): every family variant's healthy port passes the corpus
judge over a 192-id corpus (3 windows of 64). The MoE variant is the false alarm the issue names (the
corpus judge now shares check's routing policy, harness/quality/moe.py) (builder weights) runs in the
default lane; the others in the slow lane. A routing fault still fails the MoE variant's corpus verdict."""

from __future__ import annotations

import pytest

from harness.base.settings import RunSettings
from harness.quality import golden as quality
from harness.quality.judge import judge_corpus
from tests.census.ports import Shape, checkpoint
from tests.quality.test_quality import corpus_ids

VARIANTS = ("26b-a4b", "31b", "e2b", "e4b")


def _corpus_check(ckpt, tmp_path):
    ids = corpus_ids(192)
    settings = quality.golden_settings(ckpt, ids, 64)
    quality.prepare_golden_dir(tmp_path / "golden", settings)
    quality.write_shard(ckpt, ids, tmp_path / "golden", settings, 0)
    return judge_corpus(ckpt, tmp_path / "golden", settings, RunSettings(buckets=(64,), kv_len=128))


def _marks(v, i):
    return [] if (v, i) == ("26b-a4b", "builder") else [pytest.mark.slow]


@pytest.mark.parametrize("variant, init", [pytest.param(v, i, marks=_marks(v, i)) for v in VARIANTS
                                          for i in ("builder", "default")])
def test_family_variant_passes_quality(tmp_path, variant, init):
    result = _corpus_check(checkpoint(Shape(f"q{variant}", init, (), 2, variant)), tmp_path)
    judged = [c for c in result["verdict"]["checks"] if c["judged"]]
    print(variant, init, {f"{c['metric']} {c['statistic']}": round(c["ratio"], 2) for c in judged})
    assert result["passed"], ([c for c in judged if not c["passed"]], result["routing"])
    assert (result["routing"] is not None) is (variant == "26b-a4b")


def test_routing_fault_fails_moe_quality(tmp_path, monkeypatch):
    """References follow the port's routing, so the routing judge must catch a wrong choice."""
    from tests.faults.catalog import FAMILY_CATALOG

    next(f for f in FAMILY_CATALOG if f.name == "router-skips-best-expert").inject(monkeypatch)
    result = _corpus_check(checkpoint(Shape("q26b-a4b", "builder", (), 2, "26b-a4b")), tmp_path)
    assert not result["passed"] and not result["routing"]["passed"]
