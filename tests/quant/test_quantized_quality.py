"""`quality --quantize int8`: the cost of int8 weights against the unquantized model, judged at
corpus scale with QUANTIZED_QUALITY_FACTOR; deliberately bad quantizations (per-tensor scales,
4-bit rounding, truncation) exceed it. The golden is the unquantized model's."""

from __future__ import annotations

import pytest
import torch

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


BAD = {"per-tensor": scheme.Scheme(granularity="tensor"), "4-bit": scheme.Scheme(bits=4),
       "truncate": scheme.Scheme(rounding="truncate")}


def _weight_error_power(ckpt, s: scheme.Scheme) -> float:
    """Sum over the scheme's weights of (dequantized - stored)^2: the noise the quantization adds."""
    total = 0.0
    for i in range(ckpt.spec.num_layers):
        for name, w in ckpt.layer_weights(i).items():
            if name in scheme.QUANTIZED:
                total += (scheme.dequantize(*scheme.quantize_weight(w, s), torch.float32) - w.float()).pow(2).sum().item()
    return total


@pytest.mark.slow  # about 90 CPU-seconds (golden, then one pass per scheme); default-lane sibling: test_quantized_ports_are_judged_by_their_own_factor
def test_int8_cost_is_within_the_threshold_and_bad_quantizations_exceed_it(tiny0_ckpt, golden, monkeypatch):
    """int8 passes and each bad quantization fails; prints the margin on both sides of the factor
    and each scheme's weight error power against int8's (what bounds how far apart they can be)."""
    worst, power = {}, {}
    for name, s in (("int8", scheme.INT8), *BAD.items()):
        monkeypatch.setitem(scheme.SCHEMES, "int8", s)
        result = judge_corpus(tiny0_ckpt, *golden, RunSettings(buckets=(64,), kv_len=256, quantize="int8"),
                              factor=quality_factor("int8"))
        worst[name] = max(c["ratio"] for c in result["verdict"]["checks"] if c["judged"])
        power[name] = _weight_error_power(tiny0_ckpt, s)
        assert result["passed"] is (name == "int8"), (name, worst[name])
    print(f"threshold {QUANTIZED_QUALITY_FACTOR:g}x the bf16 reference's KL and |delta-p| at every judged statistic")
    for name in worst:
        side = (f"headroom {QUANTIZED_QUALITY_FACTOR / worst[name]:.2f}x" if name == "int8"
                else f"over by {worst[name] / QUANTIZED_QUALITY_FACTOR:.2f}x")
        print(f"  {name:<10} worst judged port/bf16 ratio {worst[name]:8.2f} ({side}); weight error power "
              f"{power[name] / power['int8']:.2f}x int8's")
    margin = min(worst[n] for n in BAD) / worst["int8"]
    print(f"  margin between int8 and the nearest bad quantization: {margin:.2f}x")
    assert all(power[n] >= 2 * power["int8"] for n in BAD)  # each is a worse quantization, not a relabelling


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
