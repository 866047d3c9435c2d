"""The done-when run of `gemma-parity quality` on the tiny model (slow: the fp32 and bf16 reference
passes stream 320 windows): 20,480 shipped token ids, windows of 64 (20,160 positions). The healthy
port passes with every judged statistic within the stated factor of the bf16 reference; three
catalog faults that `check`'s default prompts also catch fail it by a wide margin; the golden of
20,160 positions stays under 6 MB."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.base.settings import RunSettings
from harness.quality import golden as quality
from harness.quality.judge import judge_corpus
from tests.faults.catalog import BY_NAME
from tests.quality.test_quality import corpus_ids

pytestmark = pytest.mark.slow
GOLDEN_BOUND = 6_000_000  # bytes for 20,160 positions at top-32 (measured 5,765,380)
DOC = Path(__file__).resolve().parents[2] / "docs" / "quality.md"
FAULTS = ("rmsnorm-one-plus-weight", "missing-v-norm", "rope-interleaved-pairs")


@pytest.fixture(scope="module")
def golden(tiny0_ckpt, tmp_path_factory):
    ids = corpus_ids(20_480)
    directory = tmp_path_factory.mktemp("corpus") / "golden"
    settings = quality.golden_settings(tiny0_ckpt, ids, 64)  # the command's defaults (docs/quality.md's run)
    quality.prepare_golden_dir(directory, settings)
    quality.write_shard(tiny0_ckpt, ids, directory, settings, 0)
    return directory, settings


def _judge(ckpt, golden):
    return judge_corpus(ckpt, *golden, RunSettings(buckets=(64,), kv_len=256))


def test_healthy_port_passes_over_20k_positions_and_the_golden_is_compact(tiny0_ckpt, golden):
    result = _judge(tiny0_ckpt, golden)
    judged = [c for c in result["verdict"]["checks"] if c["judged"]]
    print("port/bf16 ratios:", {f"{c['metric']} {c['statistic']}": round(c["ratio"], 2) for c in judged})
    assert result["golden"]["positions"] == 320 * 63 >= 20_000
    assert result["verdict"]["judged"] == ["mean", "p50", "p90", "p99", "p99.9"]
    assert result["passed"], [c for c in judged if not c["passed"]]
    assert result["golden"]["bytes"] < GOLDEN_BOUND
    _check_the_documented_calibration(result, judged)


def _check_the_documented_calibration(result: dict, judged: list[dict]) -> None:
    """docs/quality.md's calibration block is what `gemma-parity quality` prints for this run (each
    line of it, spacing aside), and its largest ratio is this run's."""
    from harness.report.quality import format_quality

    doc = DOC.read_text()
    block = re.search(r"```text\n(  corpus: .*?)```", doc, re.S)
    assert block, "docs/quality.md: no calibration block"
    output = format_quality(result)
    printed = {" ".join(line.split()) for line in output.splitlines()}
    for line in filter(str.strip, block.group(1).splitlines()):
        assert " ".join(line.split()) in printed, (
            f"docs/quality.md says {line.strip()!r}; the run prints otherwise:\n{output}")
    worst = max(judged, key=lambda c: c["ratio"])
    stat = "KL" if worst["metric"] == "kl" else "|dp|"
    assert f"**{worst['ratio']:.2f} ({stat} {worst['statistic']})**" in doc, (worst, "docs/quality.md's largest ratio")


@pytest.mark.parametrize("fault", FAULTS)
def test_catalog_faults_fail_quality(tiny0_ckpt, golden, monkeypatch, fault):
    BY_NAME[fault].inject(monkeypatch)
    result = _judge(tiny0_ckpt, golden)
    assert not result["passed"]
    kl = {c["statistic"]: c["ratio"] for c in result["verdict"]["checks"] if c["metric"] == "kl"}
    assert min(kl[s] for s in result["verdict"]["judged"]) > 10, kl
