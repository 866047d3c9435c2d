"""The real 12B on the chip within its budgets, judged on the latency users see: TTFT at the
published bucket (64) against the published ~101 ms, and TPOT (one decode step); and a decode step
of every batch size of DEVICE_BATCHES within its own absolute budget, BATCH_BUDGET_FACTOR x that
batch's floor on the instance (harness/perf/batch.py: batch_budgets). The batch path below
(device_batch_bench, batch_budget_checks) runs through the NxD double in
tests/parity/test_neuron_batch_double.py.

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
# The device builds these tests make (tests/unit/test_inf2_budget.py plans the device job from every
# `neuron` module's DEVICE_BUILDS): the bench's perf build at bucket 64 (the workflow's bench step
# reuses it from the cache) and a perf build of 8 KV slots (its batch buckets 1, 2, 4, 8).
DEVICE_BUILDS = [{"model": "12b", "buckets": [64], "kv_len": 256, "batch": 1, "capture": False},
                 {"model": "12b", "buckets": [64], "kv_len": 256, "batch": 8, "capture": False}]
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
    if os.environ.get("GEMMA_PARITY_CALIBRATE"):  # the measured times, for the next plan (docs/neuron.md)
        import statistics

        from harness.backends.neuron_calibration import record_latency

        record_latency(None, statistics.median(result["metrics"]["decode_ms_per_token"]),
                       {b: statistics.median(v) for b, v in result["prefill_ms_by_bucket"].items()})
    return result


DEVICE_BATCHES = (1, 2, 4, 8)


def device_batch_bench(checkpoint, settings, batches=DEVICE_BATCHES, runs: int = perf.DEFAULT_RUNS,
                       new_tokens: int = perf.DEFAULT_NEW_TOKENS) -> dict:
    """`bench --batch` of `batches` on `settings` (prompts of the smallest bucket): {"batch": block}."""
    from harness.perf.batch import run_batch_bench

    return {"batch": run_batch_bench(checkpoint, settings, batches, runs=runs, new_tokens=new_tokens,
                                     prompt_len=min(settings.buckets))}


def batch_budget_checks(result: dict) -> dict[int, perf.BudgetCheck]:
    """batch size -> its decode step's median against BATCH_BUDGET_FACTOR x its floor."""
    from harness.perf.batch import batch_budgets
    from harness.perf.samples import batch_samples

    checks = perf.check_budgets(batch_samples(result), batch_budgets(result))
    return {int(c.metric.rsplit("@b", 1)[1]): c for c in checks}


@pytest.fixture(scope="module")
def device_batch_run() -> dict:
    from harness.base.settings import RunSettings
    from harness.inputs.checkpoint import Checkpoint

    settings = RunSettings(backend="neuron", dtype="bf16", buckets=(perf.PUBLISHED_BUCKET,), batch=max(DEVICE_BATCHES))
    return device_batch_bench(Checkpoint.open(checkpoint_path()), settings)


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


@pytest.mark.parametrize("batch", DEVICE_BATCHES)
def test_decode_step_per_batch_within_budget(device_batch_run, batch):
    from harness.perf.batch import BATCH_BUDGET_FACTOR

    check = batch_budget_checks(device_batch_run)[batch]
    row = next(r for r in device_batch_run["batch"]["rows"] if r["batch"] == batch)
    assert check.ok, (f"batch {batch}: decode step median {check.current_median:.1f} ms is over its "
                      f"{check.budget_ms:.1f} ms budget ({BATCH_BUDGET_FACTOR:g}x the {row['step_floor_ms']:.1f} ms "
                      f"floor, {row['bound']}-bound); {row['tokens_per_s']:.0f} tokens/s")
