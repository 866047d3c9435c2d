"""The real 12B on the chip within its budgets: prefill at the published bucket (64) and decode.

Needs an inf2 host (`pytest -m neuron`) and GEMMA_PARITY_12B_CHECKPOINT pointing at the
gemma-4-12B-it checkpoint directory. The run is added to the history (GEMMA_PARITY_PERF_HISTORY,
default perf-history/) before any budget is judged, so a slow run is on record too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import perf

pytestmark = pytest.mark.neuron

CHECKPOINT_ENV = "GEMMA_PARITY_12B_CHECKPOINT"
HISTORY_ENV = "GEMMA_PARITY_PERF_HISTORY"


@pytest.fixture(scope="module")
def device_run() -> dict:
    path = os.environ.get(CHECKPOINT_ENV)
    if not path:
        pytest.skip(f"{CHECKPOINT_ENV} is not set: point it at the gemma-4-12B-it checkpoint directory")
    from harness.checkpoint import Checkpoint

    result = perf.run_bench(Checkpoint.open(path), backend="neuron", runs=perf.DEFAULT_RUNS,
                            warmup=perf.DEFAULT_WARMUP, buckets=(perf.PUBLISHED_BUCKET,),
                            new_tokens=perf.DEFAULT_NEW_TOKENS, tp=2, dtype="bf16")
    perf.append_history(result, Path(os.environ.get(HISTORY_ENV, "perf-history")))
    return result


def budget(result: dict, metric: str) -> perf.BudgetCheck:
    return perf.check_budgets(perf.metric_samples(result), {metric: perf.BUDGETS[metric]})[0]


def test_prefill_at_the_published_bucket_within_budget(device_run):
    assert device_run["prefill_bucket"] == perf.PUBLISHED_BUCKET == 64
    check = budget(device_run, "prefill_ms")
    assert check.ok, (f"prefill median {check.current_median:.1f} ms at bucket 64 is over the "
                      f"{check.budget_ms:g} ms budget (the published port's first-token prefill); "
                      f"summary: {device_run['summary']['prefill_ms']}")


def test_decode_per_token_within_budget(device_run):
    check = budget(device_run, "decode_ms_per_token")
    assert check.ok, (f"decode median {check.current_median:.1f} ms/token is over the "
                      f"{check.budget_ms:g} ms budget (2x the 28 ms weight-read floor); "
                      f"summary: {device_run['summary']['decode_ms_per_token']}")
