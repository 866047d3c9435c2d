"""`bench --quantize int8` times the unquantized build beside it in one run, with both floors;
`perf compare` refuses to compare an int8 run with an unquantized one (another configuration,
never a regression), even with --allow-mismatch."""

from __future__ import annotations

import json

import pytest

from harness.base.errors import HarnessInputError
from harness.perf.compare import check_comparable


def _result(**extra):
    return {"machine": {"cpu_model": "x", "neuron_cores": 0}, "spec_hash": "s", "backend": "cpu", "tp": 2,
            "dtype": "bf16", "prefill_bucket": 16, **extra}


def test_compare_refuses_quantized_against_unquantized_even_with_allow_mismatch():
    for allow in (False, True):
        with pytest.raises(HarnessInputError, match="quantize none vs int8: they are different configurations"):
            check_comparable(_result(), _result(quantize="int8"), allow_mismatch=allow)
    assert check_comparable(_result(quantize="int8"), _result(quantize="int8")) == []
    assert check_comparable(_result(), _result()) == []  # unquantized results (no field) as before
    assert check_comparable(_result(tp=1), _result(), allow_mismatch=True)  # other mismatches: still allowed


@pytest.mark.slow  # two builds timed (~10 CPU-seconds); default-lane sibling: the compare refusal above
def test_bench_quantize_times_both_builds_with_their_floors(tmp_path, capsys):
    from harness.cli import main

    out, plain = tmp_path / "int8.json", tmp_path / "bf16.json"
    common = ["--model", "tiny", "--runs", "3", "--warmup", "0", "--new-tokens", "3", "--buckets", "16", "--kv-len", "64"]
    assert main(["bench", *common, "--quantize", "int8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    beside = result["unquantized"]
    assert result["quantize"] == "int8" and "--quantize int8 beside the unquantized build" in printed
    int8, unquantized = beside["floors"]["int8"], beside["floors"]["unquantized"]
    # int8 moves fewer weight bytes; the floor drops only when the step is memory-bound on the measured
    # rates (a slow host's matmul rate can make the tiny decode compute-bound: the same floor)
    assert int8["decode_memory_ms"] < unquantized["decode_memory_ms"]
    assert int8["decode_floor_ms"] <= unquantized["decode_floor_ms"]
    assert int8["decode_bound"] != "memory" or int8["decode_floor_ms"] < unquantized["decode_floor_ms"]
    assert beside["latency_summary"]["tpot_ms"]["p50"] > 0
    # the run's own roofline counts the int8 weights, the build beside it the unquantized ones
    decode = {name: next(r for r in block["graphs"] if r["graph"] == "decode")
              for name, block in (("int8", result["roofline"]), ("unquantized", beside["roofline"]))}
    assert decode["int8"]["weight_bytes"] < 0.75 * decode["unquantized"]["weight_bytes"]
    assert main(["bench", *common, "--out", str(plain)]) == 0
    assert "unquantized" not in json.loads(plain.read_text())  # an unquantized bench is as before
    assert main(["perf", "compare", "--baseline", str(plain), "--current", str(out), "--allow-mismatch"]) == 2
