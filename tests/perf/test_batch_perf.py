"""Performance per batch (harness/perf/batch.py): the KV fit grows one slot per sequence and an
unfit batch is refused with its numbers; a batched decode step's floor reads the weights once and
every row's KV; the batch bench times what it generates and pins each row's tokens."""

from __future__ import annotations

import pytest

from harness import FIXTURES_DIR
from harness.base.errors import HarnessInputError
from harness.inputs.spec import load_spec
from harness.perf.batch import batch_costs, batch_floors, time_batch
from harness.plan.batch_fit import batch_fit, refuse_unfit_batch
from harness.perf.roofline import instance_rates
from harness.port.decode import generate


@pytest.fixture(scope="module")
def spec12b():
    return load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")


def test_batch_fit_adds_one_kv_slot_per_sequence_and_refuses_with_numbers(spec12b):
    one, eight = (batch_fit(spec12b, 2, "bfloat16", b, 4096) for b in (1, 8))
    assert eight["kv_bytes"] == 8 * one["kv_bytes"] and eight["weights_bytes"] == one["weights_bytes"]
    assert one["fits"] and not eight["fits"]
    assert 1 <= one["max_batch"] < 8 and batch_fit(spec12b, 2, "bfloat16", one["max_batch"], 4096)["fits"]
    assert not batch_fit(spec12b, 2, "bfloat16", one["max_batch"] + 1, 4096)["fits"]
    refuse_unfit_batch(one)
    with pytest.raises(HarnessInputError, match=r"--batch 8 at --kv-len 4096: .* at most \d+ sequences"):
        refuse_unfit_batch(eight)


def test_a_batched_decode_reads_the_weights_once_and_each_rows_kv(spec12b):
    one, four = (batch_costs(spec12b, 2, "bf16", b, tokens=1, kv_len=4096) for b in (1, 4))
    assert four["weight_bytes"] == one["weight_bytes"]
    assert four["kv_bytes"] == pytest.approx(4 * one["kv_bytes"], rel=1e-6)
    assert four["flops"] == pytest.approx(4 * one["flops"], rel=1e-6)
    rows = batch_floors(spec12b, 2, "bf16", (1, 2, 4, 8), 4096, rates=instance_rates("inf2.8xlarge", 2, "bf16"))
    per_s = [r["tokens_per_s_floor"] for r in rows if r["graph"] == "decode"]
    assert per_s == sorted(per_s) and per_s[-1] > 4 * per_s[0]  # nearly linear while the weights bind


def test_time_batch_pins_each_rows_tokens(tiny0_ckpt):
    from tests.parity.batch_support import batch_engine

    be = batch_engine(tiny0_ckpt, batch=2)
    prompts = [[5, 6, 7], list(range(10, 30))]
    out = time_batch(be, prompts, new_tokens=3, runs=2)
    alone = [generate(be, [p], 3)[0].tokens for p in prompts]
    assert out["tokens"] == alone and out["batch"] == 2
    assert len(out["step_samples_ms"]) == 2 * 2 and out["tokens_per_s"] > 0
