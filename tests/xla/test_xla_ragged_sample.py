"""A sample of the ragged property (tests/parity/test_ragged_property.py) on the xla backend: a few
fixed ragged prompt sets through the batched device graphs (seq_ids, a KV cache of slots), each
sequence's fp32 tokens, logits and capture points those of its prompt served alone by the same
backend's batch-1 graphs; speculating too (the drafter reading each sequence's own KV slot, one
batched verify call per round), accepted drafts included. The lane's time goes to compiling
graphs, so the sample is a few of the issue's shapes at small buckets; the property over random
sets runs on cpu."""

from __future__ import annotations

import functools

import pytest

from harness.base.settings import RunSettings
from tests.parity.test_ragged_property import BUCKETS, CASES, K, KV_LEN, assert_batch_equals_alone
from tests.unit.test_speculate import random_pair  # noqa: F401  (the fixture: the tiny 12B and a random assistant)

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def xla_engines(tiny0_ckpt, request):
    """(batch, tp, spec) -> (engine, drafter) on the xla backend, cached (test_ragged_property's engines)."""
    from harness.backends import build_drafter, build_engine

    @functools.lru_cache(maxsize=None)
    def build(batch: int, tp: int, spec: bool):
        settings = RunSettings(backend="xla", tp=tp, dtype="float32", buckets=BUCKETS, kv_len=KV_LEN, batch=batch,
                               speculate=K if spec else 0)
        engine = build_engine(tiny0_ckpt, settings, capture=True)
        return engine, (build_drafter(engine, request.getfixturevalue("random_pair")[1]) if spec else None)
    return build


@pytest.mark.parametrize("name, spec", [("all in one bucket", False), ("slot reuse", False), ("slot reuse", True)])
def test_a_ragged_batch_on_xla_serves_each_prompt_as_alone(xla_engines, name, spec):
    lengths, batch = CASES[name]
    assert_batch_equals_alone(xla_engines, lengths, batch, spec=spec)
