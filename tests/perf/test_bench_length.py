"""`bench --lengths` on the tiny model: one entry per length with its floor, `perf compare` on the
`ttft_ms@L` / `tpot_ms@L` metrics, the lengths' pinned outputs, and the latency-vs-length PNG.

Timings are never judged: slowdowns are planted in copies of a real result.
"""

from __future__ import annotations

import copy
import json

import pytest

from harness import perf
from harness.cli import main as cli_main
from harness.inputs.checkpoint import Checkpoint
from harness.inputs.tiny import tiny_checkpoint
from harness.perf.context import context_floors
from harness.perf.roofline import Rates

RUNS, NEW_TOKENS, LENGTHS, KV_LEN, BUCKETS = 3, 2, (8, 20, 40), 64, (8, 16)
BENCH_ARGS = ["--model", "tiny", "--backend", "cpu", "--runs", RUNS, "--warmup", 0, "--buckets", "8,16",
              "--new-tokens", NEW_TOKENS, "--kv-len", KV_LEN, "--tp", 1, "--dtype", "fp32"]


def run_cli(*argv) -> int:
    return cli_main([str(a) for a in argv])


@pytest.fixture(scope="module")
def benched(tmp_path_factory):
    """One bench with lengths through the CLI: 8 (one chunk), 20 and 40 (chunked prefill)."""
    tmp = tmp_path_factory.mktemp("length")
    code = run_cli("bench", *BENCH_ARGS, "--lengths", "40,8,20", "--out", tmp / "a.json")
    return tmp, code, perf.load_result(tmp / "a.json")


def test_one_entry_per_length_with_its_floor(benched):
    _, code, result = benched
    assert code == 0
    block = result["at_length"]
    assert [r["length"] for r in block["lengths"]] == list(LENGTHS)
    spec = Checkpoint.open(tiny_checkpoint(seed=0)).spec
    rates = Rates(**result["roofline"]["rates"])  # the same rates as the per-graph floors
    for row in block["lengths"]:
        assert len(row["ttft_ms"]) == len(row["tpot_ms"]) == RUNS
        assert [len(s) for s in row["tpot_steps_ms"]] == [NEW_TOKENS] * RUNS
        assert row["tpot_ms"] == pytest.approx([sum(s) / NEW_TOKENS for s in row["tpot_steps_ms"]])
        want = context_floors(spec, 1, "fp32", row["length"], buckets=BUCKETS, max_len=KV_LEN, rates=rates,
                              sliding_cache="linear")
        assert row["floor"]["ttft_ms"] == pytest.approx(want["ttft_ms"])
        assert row["floor"]["tpot_ms"] == pytest.approx(want["tpot_ms"])
    # each decode step from position L reads the smallest KV bucket holding L + 1 (16, 32, 64)
    assert [r["floor"]["decode_kv_bucket"] for r in block["lengths"]] == [16, 32, 64]
    ttft_floors = [r["floor"]["ttft_ms"] for r in block["lengths"]]
    assert ttft_floors == sorted(ttft_floors) and ttft_floors[0] < ttft_floors[-1]
    names = set(perf.metric_samples(result))
    assert {f"{m}@{n}" for m in ("ttft_ms", "tpot_ms") for n in LENGTHS} <= names


def test_pinned_tokens_are_the_greedy_continuation(benched):
    """The lengths' pinned tokens are what the engine generates greedily from each prompt."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.perf.bench import bench_prompt

    _, _, result = benched
    ckpt = Checkpoint.open(tiny_checkpoint(seed=0))
    engine = build_engine(ckpt, RunSettings(backend="cpu", tp=1, dtype="fp32", buckets=BUCKETS, kv_len=KV_LEN))
    pinned = result["at_length"]["outputs"]
    assert pinned["runs_agree"] is True
    for entry in pinned["prompts"]:
        prompt = bench_prompt(ckpt.spec.vocab_size, entry["length"])
        token = int(engine.prefill(prompt).logits[-1].argmax())
        tokens = [token]
        for step in range(NEW_TOKENS):
            token = int(engine.decode_step(token, len(prompt) + step).logits.argmax())
            tokens.append(token)
        assert entry["tokens"] == tokens


def _with_samples(result: dict, slow: int | None = None) -> dict:
    """A copy with 6 samples per length (enough for p < 0.01), the length `slow` 1.5x slower in TTFT."""
    out = copy.deepcopy(result)
    for row in out["at_length"]["lengths"]:
        base = sorted(row["ttft_ms"])[1]
        row["ttft_ms"] = [base * (1 + 0.01 * k) * (1.5 if row["length"] == slow else 1) for k in range(6)]
        row["tpot_ms"] = [sorted(row["tpot_ms"])[1] * (1 + 0.01 * k) for k in range(6)]
    return out


def test_compare_flags_a_slowdown_at_one_length(benched):
    _, _, result = benched
    base = _with_samples(result)
    comp = perf.compare_results(base, _with_samples(result, slow=20))
    assert comp.regressions == ["ttft_ms@20"]
    assert comp.failed
    same = perf.compare_results(base, copy.deepcopy(base))
    assert not same.failed and not same.regressions
    assert {m.metric: m.verdict for m in same.metrics}["ttft_ms@20"] == "ok"


def test_budget_on_a_length_metric(benched):
    _, _, result = benched
    median = sorted(result["at_length"]["lengths"][1]["ttft_ms"])[1]
    comp = perf.compare_results(None, result, budgets={"ttft_ms@20": median / 2})
    assert comp.broken_budgets == ["ttft_ms@20"]


def test_result_without_lengths_stays_comparable(benched):
    _, _, result = benched
    old = copy.deepcopy(result)
    del old["at_length"]
    comp = perf.compare_results(old, result)
    assert not comp.failed
    assert {m.metric: m.verdict for m in comp.metrics}["tpot_ms@40"] == "only in current"
    assert all("at length" not in n for n in comp.notes)


def test_changed_tokens_at_a_length_refuse_the_comparison(benched):
    _, _, result = benched
    changed = copy.deepcopy(result)
    changed["at_length"]["outputs"]["prompts"][2]["tokens"][1] += 1
    comp = perf.compare_results(result, changed)
    assert comp.failed and "at length" in comp.output_change and "prompt 2 step 1" in comp.output_change
    assert all(not m.regressed for m in comp.metrics)


def test_compare_writes_the_length_png_beside_the_markdown(benched, tmp_path):
    pytest.importorskip("matplotlib", reason="the length plot needs the plot extra")
    tmp, _, _ = benched
    code = run_cli("perf", "compare", "--baseline", tmp / "a.json", "--current", tmp / "a.json",
                   "--markdown", tmp_path / "perf.md")
    assert code == 0
    png = tmp_path / "perf-length.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "perf.md").read_text()
    assert "](perf-length.png)" in markdown and "| 40 |" in markdown


def test_corrupt_length_samples_are_refused(benched, tmp_path, capsys):
    tmp, _, result = benched
    bad = copy.deepcopy(result)
    bad["at_length"]["lengths"][1]["tpot_ms"] = []
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    code = run_cli("perf", "compare", "--baseline", tmp / "a.json", "--current", tmp_path / "bad.json")
    assert code == 2
    assert "at_length.lengths[20].tpot_ms" in capsys.readouterr().err


@pytest.mark.parametrize("lengths, words", [("8,63", "63 + --new-tokens 2 exceed the KV length 64"),
                                            ("8,x", "positive prompt lengths"), ("0", "positive prompt lengths")])
def test_bad_lengths_exit_2_before_any_work(tmp_path, capsys, lengths, words):
    try:
        code = run_cli("bench", *BENCH_ARGS, "--lengths", lengths, "--out", tmp_path / "r.json")
    except SystemExit as exc:  # argparse refuses a malformed list itself
        code = exc.code
    assert code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
