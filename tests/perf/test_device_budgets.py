"""The real 12B on the chip within its budgets, judged on the latency users see: TTFT at the
published bucket (64) against the published ~101 ms, and TPOT (one decode step).

Needs an inf2 host (`pytest -m neuron`) and GEMMA_PARITY_12B_CHECKPOINT pointing at the
gemma-4-12B-it checkpoint directory. A device run without it FAILS, naming the variable, as a
missing NeuronCore does: a green device run must have checked the budget. The run is added to the
history (GEMMA_PARITY_PERF_HISTORY, default perf-history/) before any budget is judged, so a slow
run is on record too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import perf

pytestmark = pytest.mark.neuron

CHECKPOINT_ENV = "GEMMA_PARITY_12B_CHECKPOINT"
HISTORY_ENV = "GEMMA_PARITY_PERF_HISTORY"


def checkpoint_path() -> Path:
    """The 12B checkpoint directory, or a test failure that says what to set."""
    path = os.environ.get(CHECKPOINT_ENV)
    if not path:
        pytest.fail(f"{CHECKPOINT_ENV} is not set: the device budgets need the real 12B. Set it to the "
                    "gemma-4-12B-it checkpoint directory (config.json + *.safetensors), e.g. "
                    f"`export {CHECKPOINT_ENV}=/data/gemma-4-12B-it`, and re-run `pytest -m neuron`.",
                    pytrace=False)
    if not (Path(path) / "config.json").is_file():
        pytest.fail(f"{CHECKPOINT_ENV}={path}: no config.json there; point it at the gemma-4-12B-it "
                    "checkpoint directory", pytrace=False)
    return Path(path)


@pytest.fixture(scope="module")
def device_run() -> dict:
    from harness.inputs.checkpoint import Checkpoint

    from harness.base.settings import RunSettings

    result = perf.run_bench(Checkpoint.open(checkpoint_path()),
                            RunSettings(backend="neuron", dtype="bf16", buckets=(perf.PUBLISHED_BUCKET,)),
                            runs=perf.DEFAULT_RUNS, warmup=perf.DEFAULT_WARMUP, new_tokens=perf.DEFAULT_NEW_TOKENS)
    perf.append_history(result, Path(os.environ.get(HISTORY_ENV, "perf-history")))
    return result


def budget(result: dict, metric: str) -> perf.BudgetCheck:
    return perf.check_budgets(perf.budget_samples(result), {metric: perf.BUDGETS[metric]})[0]


def test_ttft_at_the_published_bucket_within_budget(device_run):
    assert device_run["prefill_bucket"] == perf.PUBLISHED_BUCKET == 64
    check = budget(device_run, "ttft_ms")
    floor = next(g for g in device_run["roofline"]["graphs"] if g["graph"] == "prefill[64]")
    assert check.ok, (f"TTFT median {check.current_median:.1f} ms at bucket 64 is over the "
                      f"{check.budget_ms:g} ms budget (the published port's first-token prefill); floor "
                      f"{floor['floor_ms']:.1f} ms; summary: {device_run['latency_summary']['ttft_ms']}")


def test_tpot_within_budget(device_run):
    check = budget(device_run, "tpot_ms")
    assert check.ok, (f"TPOT median {check.current_median:.1f} ms/token is over the "
                      f"{check.budget_ms:g} ms budget (2x the ~27 ms weight-read floor); "
                      f"summary: {device_run['latency_summary']['tpot_ms']}")
