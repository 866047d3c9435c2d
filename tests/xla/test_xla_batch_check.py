"""`check --batch 4` with ragged prompts on the xla backend through the CLI (issue 29's done-when):
tests/parity/test_batch_check_cli.py's matrix (a 1-token prompt, prompts past the largest bucket,
five prompts for four slots: a reused slot) run on the lowered graphs, both stages and the served
build (xla's batched perf build). Each run is a whole check, several CPU-minutes (every (batch
bucket, sequence bucket, KV bucket) shape is compiled by XLA, in fp32, bf16 and the perf build;
measured: E2B at TP 1 229 CPU-s; the tiny 12B at TP 2 about 10 CPU-minutes), so the lane runs two family variants, which the 12B's batch tests (tests/xla/test_xla_batch.py:
isolation, the perf build, bench) do not cover: E2B at TP 1 (per-layer inputs and KV sharing per slot) and 26B-A4B at TP 2 (routing per row, with
the collectives; run alone after the parallel part, as .ci/xla-lane runs the family's TP 2 checks).
The rest of the matrix is `-m matrix` (in no CI lane; run by hand in the XLA venv:
`pytest -m matrix tests/xla/test_xla_batch_check.py`)"""

from __future__ import annotations

import pytest

from tests.parity.test_batch_check_cli import assert_batched_check_passed, run_check

pytestmark = pytest.mark.xla
LANE = [("tiny-e2b", 1), ("tiny-26b-a4b", 2)]
BY_HAND = [("tiny", 1), ("tiny", 2), ("tiny-e2b", 2), ("tiny-e4b", 1), ("tiny-e4b", 2), ("tiny-31b", 1), ("tiny-31b", 2),
           ("tiny-26b-a4b", 1)]


@pytest.mark.parametrize("model, tp", LANE + [pytest.param(*pair, marks=pytest.mark.matrix) for pair in BY_HAND])
def test_check_batch_4_with_ragged_prompts_passes_on_xla(model, tp, tmp_path, capsys):
    rc, payload, _ = run_check(tmp_path, model, tp, "--backend", "xla")
    assert_batched_check_passed(rc, payload, capsys.readouterr().out, "xla")
    assert payload["stages"]["fp32"]["passed"] is True  # the fp32 stage ran the lowered graphs too
    served = payload["extra_stages"]["served"]  # xla's batched perf build, each row's last real row
    assert served["ran"] and served["passed"] and served["backend"] == "xla" and served["last_row_only"] is True
