"""`gemma-parity quality`: the corpus golden (streamed, sharded, resumable, compact), the judged
pass (port and bf16 reference against fp32, side by side) and its verdict, reports and refusals.
The 20K-position run (healthy seeds pass, three catalog faults fail, the golden's size bound) is
in test_quality_corpus.py, marked slow."""

from __future__ import annotations

import json

import pytest
import torch

from harness import FIXTURES_DIR
from harness.base.settings import RunSettings
from harness.cli import main
from harness.quality import golden as quality
from harness.quality.judge import judge_corpus
from harness.quality.stats import FLOORS, position_metrics, reference_stats, verdict

SMALL_WINDOW = 32


CORPUS = FIXTURES_DIR / "corpus" / "tiny-20k.json"  # tests/quality/corpus.py made it from the tiny model


def corpus_ids(n: int) -> list[int]:
    """The first `n` ids of the shipped corpus (sampled from the tiny model's own distributions)."""
    return json.loads(CORPUS.read_text())[:n]


def write_corpus(path, n: int) -> str:
    path.write_text(json.dumps(corpus_ids(n)))
    return str(path)


def golden_files(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---- the statistics ---------------------------------------------------------------------------------

def test_kl_on_topk_plus_tail_is_zero_for_the_same_distribution_and_exact_for_a_known_one():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0, -2.0]])
    targets = torch.tensor([1])
    golden = reference_stats(logits, targets, k=2)
    same = position_metrics(golden, torch.log_softmax(logits.double(), -1), targets)
    assert float(same["kl"][0]) < 1e-7 and abs(float(same["dp"][0])) < 1e-7 and bool(same["top1"][0])
    other = torch.tensor([[1.0, 3.0, 0.0, -1.0, -2.0]])
    got = position_metrics(golden, torch.log_softmax(other.double(), -1), targets)
    p, q = torch.softmax(logits.double(), -1)[0], torch.softmax(other.double(), -1)[0]
    bucket = lambda d: torch.cat([d[:2], d[2:].sum()[None]])  # top-2 support + tail
    expected = float((bucket(p) * (bucket(p) / bucket(q)).log()).sum())
    assert got["kl"][0].item() == pytest.approx(expected, rel=1e-5)
    assert not bool(got["top1"][0]) and float(got["dp"][0]) == pytest.approx(float(q[1] - p[1]), rel=1e-5)


def test_verdict_fails_a_quantile_above_the_factor_floors_exact_bf16_and_skips_thin_tails():
    spread = {s: 1e-3 for s in ("mean", "p50", "p90", "p99", "p99.9", "max")}
    bf16 = {"positions": 20_000, "kl": dict(spread), "abs_dp": dict(spread, p50=0.0)}
    port = {"positions": 20_000, "kl": dict(spread, p99=3.1e-3, max=1.0), "abs_dp": dict(spread, p50=FLOORS["abs_dp"])}
    judged = verdict(port, bf16, factor=3.0)
    failed = [(c["metric"], c["statistic"]) for c in judged["checks"] if c["passed"] is False]
    assert failed == [("kl", "p99")] and not judged["passed"]  # the floored p50 passes; the max is not judged
    assert judged["judged"] == ["mean", "p50", "p90", "p99", "p99.9"]
    assert verdict(bf16, bf16, 3.0)["passed"]
    # 500 positions: p99 has 5 beyond it, one sample's noise: reported, not judged
    thin = verdict(dict(port, positions=500), bf16, factor=3.0)
    assert thin["passed"] and thin["judged"] == ["mean", "p50", "p90"]
    # the rule is a sentence a person reads: the floors as numbers, no dict repr
    assert "{" not in judged["rule"] and "': " not in judged["rule"]
    assert f"floored at KL {FLOORS['kl']:g} and |delta-p| {FLOORS['abs_dp']:g}" in judged["rule"]


# ---- the golden ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_golden(tiny0_ckpt, tmp_path_factory):
    """256 ids, windows of 32: 8 windows, 248 positions, one part."""
    ids = corpus_ids(256)
    directory = tmp_path_factory.mktemp("quality") / "golden"
    settings = quality.golden_settings(tiny0_ckpt, ids, SMALL_WINDOW, windows_per_part=8)
    quality.prepare_golden_dir(directory, settings)
    quality.write_shard(tiny0_ckpt, ids, directory, settings, 0)
    return directory, settings


def test_the_healthy_port_passes_and_a_catalog_fault_fails(tiny0_ckpt, small_golden, monkeypatch):
    from tests.faults.catalog import BY_NAME

    directory, settings = small_golden
    healthy = judge_corpus(tiny0_ckpt, directory, settings, RunSettings(buckets=(SMALL_WINDOW,), kv_len=64))
    assert healthy["passed"], [c for c in healthy["verdict"]["checks"] if c["passed"] is False]
    assert healthy["golden"]["positions"] == 8 * (SMALL_WINDOW - 1)
    # the bf16 reference is not exact against fp32, so the comparison is not against zero
    assert healthy["bf16_reference"]["kl"]["mean"] > 0 and healthy["port"]["kl"]["mean"] > 0
    BY_NAME["rmsnorm-one-plus-weight"].inject(monkeypatch)
    faulty = judge_corpus(tiny0_ckpt, directory, settings, RunSettings(buckets=(SMALL_WINDOW,), kv_len=64))
    assert not faulty["passed"]
    kl_mean = next(c for c in faulty["verdict"]["checks"] if (c["metric"], c["statistic"]) == ("kl", "mean"))
    assert kl_mean["ratio"] > 10 and faulty["port"]["top1_agreement"] < healthy["port"]["top1_agreement"]


def test_golden_is_compact(small_golden):
    directory, settings = small_golden
    positions = settings.windows * (settings.window - 1)
    per_position = quality.golden_bytes(directory) / positions
    # top-k ids (int32) and log-probs (fp32), six 4-byte columns, one int8, the window's ids, headers
    assert per_position <= 8 * settings.topk + 40, per_position


def test_windows_beyond_the_largest_bucket_run_as_decode_steps(tiny0_ckpt, small_golden):
    """A bucket of 16 and windows of 32: the second half of each window is teacher-forced decode
    on the KV cache; it is judged the same (and passes on the healthy port)."""
    directory, settings = small_golden
    chunked = judge_corpus(tiny0_ckpt, directory, settings, RunSettings(buckets=(16,), kv_len=64))
    assert chunked["passed"] and chunked["golden"]["positions"] == 8 * (SMALL_WINDOW - 1)


TINY_ARGS = ["--window", "8", "--buckets", "8", "--kv-len", "16"]


def test_interrupted_reference_pass_resumes_to_the_same_bytes(tiny0_ckpt, tmp_path, monkeypatch):
    ids = corpus_ids(2 * 8)
    settings = quality.golden_settings(tiny0_ckpt, ids, 8, windows_per_part=1)  # one window per part

    def reference_pass(directory):
        quality.prepare_golden_dir(directory, settings)
        return quality.write_shard(tiny0_ckpt, ids, directory, settings, 0)

    reference_pass(tmp_path / "straight")
    compute, write, calls = quality._part_tensors, quality.write_part, []

    def interrupted(*args):
        if len(list(resumed.rglob("part-*.safetensors"))) == 1:
            raise KeyboardInterrupt  # Ctrl-C once one window is written
        return compute(*args)

    monkeypatch.setattr(quality, "_part_tensors", interrupted)
    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        reference_pass(resumed)
    assert len(list(resumed.rglob("part-*.safetensors"))) == 1 and not list(resumed.rglob("complete.json"))
    monkeypatch.setattr(quality, "_part_tensors", compute)
    monkeypatch.setattr(quality, "write_part", lambda file, data: (calls.append(file.name), write(file, data)))
    reference_pass(resumed)
    assert calls == ["part-00001.safetensors"]  # only the missing part
    assert golden_files(resumed) == golden_files(tmp_path / "straight")


def test_shards_are_merged_by_the_judged_pass_and_an_altered_part_is_refused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "ids.json", 4 * 8)
    golden = tmp_path / "golden"
    common = ["quality", "--model", "tiny", "--corpus", corpus, "--golden", str(golden), *TINY_ARGS]
    assert main(common + ["--shard", "1/2"]) == 0
    assert "shards still missing: [0]" in capsys.readouterr().out
    assert main(common + ["--shard", "0/2"]) == 0
    out, report = tmp_path / "q.json", tmp_path / "report"
    rc = main(common + ["--json", str(out), "--report", str(report)])
    payload = json.loads(out.read_text())
    # 28 positions: the verdict is the mean's and the median's (exit 0 or 1 by it), the files are the test
    assert rc == (0 if payload["passed"] else 1) and payload["verdict"]["judged"] == ["mean", "p50"]
    assert payload["settings"]["shards"] == 2 and payload["golden"]["positions"] == 4 * 7
    assert payload["generator"].startswith("gemma-parity quality")
    assert {p.name for p in report.iterdir()} >= {"quality.md", "quality.json", "worst_prompts.json"}
    # every table row of quality.md has its header's cell count: |dp| escaped, never a cell border
    md = (report / "quality.md").read_text()
    assert "| \\|dp\\| mean |" in md and "{" not in md
    for table in md.split("\n\n"):
        rows = [r.replace("\\|", "") for r in table.splitlines() if r.startswith("|")]
        assert len({r.count("|") for r in rows}) <= 1, rows
    prompts = json.loads((report / "worst_prompts.json").read_text())
    worst = payload["worst_positions"][0]
    assert prompts[0] == worst["prompt"] and worst["prompt"][-len(worst["context"]):] == worst["context"]
    assert worst["kl"] == max(w["kl"] for w in payload["worst_positions"])
    part = next(golden.rglob("part-*.safetensors"))
    part.write_bytes(part.read_bytes()[:-4] + b"\0\0\0\0")
    assert main(common) == 2
    assert "sha256 differs" in capsys.readouterr().err


@pytest.mark.parametrize("extra, corpus, message", [
    (["--shard", "2/2"], None, "--shard 2/2"),
    (["--window", "1"], None, "--window 1"),
    (["--window", "40", "--kv-len", "32", "--buckets", "16"], None, "--window 40"),
    (["--topk", "0"], None, "--topk 0"),
    ([], [5, 9, 99999], "token id 99999 at index 2"),
    ([], {"tokens": [1]}, "expected a JSON list of integer token ids"),
])
def test_bad_input_exits_2_naming_it(tmp_path, capsys, extra, corpus, message):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(corpus if corpus is not None else corpus_ids(64)))
    code = main(["quality", "--model", "tiny", "--corpus", str(path), "--golden", str(tmp_path / "g"), *extra])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "g").exists()  # refused before anything was written


def test_a_golden_of_other_settings_or_a_foreign_directory_is_never_reused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "ids.json", 2 * 8)
    golden = tmp_path / "golden"
    common = ["quality", "--model", "tiny", "--corpus", corpus, "--buckets", "8", "--kv-len", "16", "--reference-only"]
    assert main(common + ["--golden", str(golden), "--window", "8"]) == 0
    before = golden_files(golden)
    assert main(common + ["--golden", str(golden), "--window", "4"]) == 2
    err = capsys.readouterr().err
    assert "written for other settings (" in err and "window" in err.split("differ")[0]
    assert golden_files(golden) == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(common + ["--golden", str(foreign), "--window", "8"]) == 2
    assert "is not a quality golden" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "mine"
