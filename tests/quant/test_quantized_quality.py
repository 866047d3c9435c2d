"""`quality --quantize int8`: the cost of int8 weights against the unquantized model, judged at
corpus scale with QUANTIZED_QUALITY_FACTOR; deliberately bad quantizations (per-tensor scales,
4-bit rounding, truncation) exceed it. The golden is the unquantized model's."""

from __future__ import annotations

import pytest

from harness.base.settings import RunSettings
from harness.inputs import quantize as scheme
from harness.quality import golden as quality
from harness.quality.judge import judge_corpus
from harness.quality.stats import QUANTIZED_QUALITY_FACTOR, quality_factor
from tests.quality.test_quality import corpus_ids

IDS = 4096  # 4,032 judged positions in windows of 64 (the calibration of QUANTIZED_QUALITY_FACTOR)


def test_quantized_ports_are_judged_by_their_own_factor():
    assert quality_factor(None) < quality_factor("int8") == QUANTIZED_QUALITY_FACTOR


@pytest.fixture(scope="module")
def golden(tiny0_ckpt, tmp_path_factory):
    ids = corpus_ids(IDS)
    directory = tmp_path_factory.mktemp("corpus") / "golden"
    settings = quality.golden_settings(tiny0_ckpt, ids, 64, windows_per_part=32)
    quality.prepare_golden_dir(directory, settings)
    quality.write_shard(tiny0_ckpt, ids, directory, settings, 0)
    return directory, settings


@pytest.mark.slow  # about 90 CPU-seconds (golden, then one pass per scheme); default-lane sibling: test_quantized_ports_are_judged_by_their_own_factor
@pytest.mark.parametrize("name, bad", [("int8", None), ("per-tensor", scheme.Scheme(granularity="tensor")),
                                       ("4-bit", scheme.Scheme(bits=4)), ("truncate", scheme.Scheme(rounding="truncate"))])
def test_int8_cost_is_within_the_threshold_and_bad_quantizations_exceed_it(tiny0_ckpt, golden, monkeypatch, name, bad):
    if bad is not None:
        monkeypatch.setitem(scheme.SCHEMES, "int8", bad)
    result = judge_corpus(tiny0_ckpt, *golden, RunSettings(buckets=(64,), kv_len=256, quantize="int8"),
                          factor=quality_factor("int8"))
    worst = max(c["ratio"] for c in result["verdict"]["checks"] if c["judged"])
    print(f"{name}: worst judged port/bf16 ratio {worst:.2f} (threshold {QUANTIZED_QUALITY_FACTOR})")
    assert result["passed"] is (bad is None), worst


@pytest.mark.slow  # a 256-token corpus through the CLI (~15 CPU-seconds); default-lane sibling: test_quantized_ports_are_judged_by_their_own_factor
def test_quality_cli_judges_int8_with_its_factor_and_says_which_question(tmp_path):
    import json

    from harness.cli import main

    corpus, out = tmp_path / "corpus.json", tmp_path / "q.json"
    corpus.write_text(json.dumps(corpus_ids(256)))
    assert main(["quality", "--model", "tiny", "--corpus", str(corpus), "--golden", str(tmp_path / "golden"),
                 "--window", "64", "--buckets", "64", "--quantize", "int8", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["verdict"]["factor"] == QUANTIZED_QUALITY_FACTOR and payload["quantize"] == "int8"
    assert any("against the unquantized model" in note for note in payload["notes"])
