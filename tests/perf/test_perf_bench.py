"""`bench` on the tiny model with the CPU backend: the file it writes is one `perf compare` accepts.

Only the shape and bookkeeping of the results are asserted; CPU timings are never judged.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from harness import perf
from harness.report import perf_text
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.cli import main as cli_main
from harness.inputs.checkpoint import Checkpoint
from harness.inputs.tiny import tiny_checkpoint
from harness.port.decode import generate

RUNS, NEW_TOKENS = 3, 2
BENCH_ARGS = ["--model", "tiny", "--backend", "cpu", "--runs", RUNS, "--warmup", 1, "--buckets", "8,16",
              "--new-tokens", NEW_TOKENS, "--kv-len", 32, "--tp", 2, "--dtype", "bf16"]


def run_cli(*argv) -> int:
    return cli_main([str(a) for a in argv])


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    """Two tiny bench runs through the CLI wiring, both added to one history (what each printed kept)."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("bench")
    codes, printed = [], []
    for name in ("a.json", "b.json"):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            codes.append(run_cli("bench", *BENCH_ARGS, "--out", tmp / name, "--history", tmp / "history"))
        printed.append(out.getvalue() + err.getvalue())
    return tmp, codes, printed


def test_bench_writes_a_complete_result(bench_runs):
    tmp, codes, printed = bench_runs
    # each run says once where its result went, and once that the history holds it
    for name, text in zip(("a.json", "b.json"), printed):
        assert text.count("wrote ") == 1 and f"wrote {tmp / name}" in text and text.count("added ") == 1, text
    assert codes == [0, 0]
    result = perf.load_result(tmp / "a.json")
    assert result["prefill_bucket"] == 16  # no 64 bucket asked for: the largest one is the headline
    assert {k: len(v) for k, v in result["prefill_ms_by_bucket"].items()} == {"8": RUNS, "16": RUNS}
    assert result["metrics"]["prefill_ms"] == result["prefill_ms_by_bucket"]["16"]
    assert [len(s) for s in result["decode_steps_ms"]] == [NEW_TOKENS] * RUNS
    assert result["metrics"]["decode_ms_per_token"] == pytest.approx(
        [sum(s) / NEW_TOKENS for s in result["decode_steps_ms"]])
    summary = result["summary"]
    assert summary["prefill_ms"]["p50"] == perf.percentile(result["metrics"]["prefill_ms"], 50)
    assert summary["tokens_per_second"] == pytest.approx(1e3 / summary["decode_ms_per_token"]["mean"])
    assert set(summary) == {"prefill_ms", "prefill_ms[8]", "decode_ms_per_token", "tokens_per_second"}
    assert result["spec_hash"] == Checkpoint.open(tiny_checkpoint(seed=0)).spec.spec_hash()
    assert (result["backend"], result["tp"], result["dtype"], result["compiler_args"]) == ("cpu", 2, "bf16", [])
    assert result["machine"]["cores"] == os.cpu_count() and result["machine"]["neuron_cores"] == 0
    assert {"python", "torch", "transformers"} <= set(result["versions"])
    assert result["settings"] == {"runs": RUNS, "warmup": 1, "buckets": [8, 16], "new_tokens": NEW_TOKENS,
                                  "kv_len": 32}
    env = result["environment"]  # what else the machine ran (its shares made quiet by tests/perf/conftest.py)
    assert env["cores"] == os.cpu_count() and 0 < env["window_s"] and len(env["load_1m"]) == 2
    assert "machine during the run: " in printed[0]


def test_bench_records_ttft_tpot_and_end_to_end(bench_runs):
    """Relations that hold by construction of the timed regions (no timing is judged): TTFT
    contains its prefill, E2E contains the headline TTFT and every decode step of its run."""
    result = perf.load_result(bench_runs[0] / "a.json")
    latency = result["latency"]
    for bucket in ("8", "16"):
        assert all(t >= p for t, p in zip(latency["ttft_ms_by_bucket"][bucket], result["prefill_ms_by_bucket"][bucket]))
    assert all(e >= t + sum(steps) for e, t, steps in zip(latency["e2e_ms"], latency["ttft_ms_by_bucket"]["16"],
                                                          result["decode_steps_ms"]))
    assert latency["generated_tokens"] == NEW_TOKENS + 1
    summary = result["latency_summary"]
    assert set(summary) == {"ttft_ms", "ttft_ms[8]", "tpot_ms", "e2e_ms", "throughput"}
    steps = [ms for run in result["decode_steps_ms"] for ms in run]
    assert summary["tpot_ms"]["n"] == RUNS * NEW_TOKENS
    assert summary["tpot_ms"]["p50"] == perf.percentile(steps, 50)
    # 3 runs, 6 decode steps: too few samples for p90 (10) or p99 (100): withheld, not made up
    assert summary["tpot_ms"]["p90"] is None and summary["tpot_ms"]["p99"] is None
    assert summary["ttft_ms"]["p90"] is None
    throughput = summary["throughput"]
    assert throughput["decode_tokens_per_s"] == pytest.approx(1e3 * len(steps) / sum(steps))
    assert throughput["e2e_tokens_per_s"] == pytest.approx((NEW_TOKENS + 1) * 1e3 / summary["e2e_ms"]["mean"])
    assert perf.budget_samples(result)["tpot_ms"] == steps


def test_bench_reports_floors_and_efficiency_per_graph(bench_runs, capsys):
    result = perf.load_result(bench_runs[0] / "a.json")
    block = result["roofline"]
    assert block["rates"]["name"] == "this machine (measured)" and block["rates"]["host_link_bytes_per_s"] is None
    assert block["rates"]["memory_bytes_per_s"] > 0 and block["rates"]["flops_per_s"] > 0
    # efficiency is judged on the time inside the graph call; the rest of the call is host-side
    graph = result["graph_ms"]
    measured = {"prefill[8]": statistics.median(graph["prefill_by_bucket"]["8"]),
                "prefill[16]": statistics.median(graph["prefill_by_bucket"]["16"]),
                "decode": statistics.median([ms for run in graph["decode_steps"] for ms in run])}
    calls = {"prefill[8]": result["prefill_ms_by_bucket"]["8"], "prefill[16]": result["prefill_ms_by_bucket"]["16"],
             "decode": [ms for run in result["decode_steps_ms"] for ms in run]}
    inside = {"prefill[8]": graph["prefill_by_bucket"]["8"], "prefill[16]": graph["prefill_by_bucket"]["16"],
              "decode": [ms for run in graph["decode_steps"] for ms in run]}
    for name, values in calls.items():
        assert all(0 < g < c for g, c in zip(inside[name], values))  # the graph call is inside the engine's
    assert [g["graph"] for g in block["graphs"]] == list(measured)
    spec = Checkpoint.open(tiny_checkpoint(seed=0)).spec
    for graph in block["graphs"]:
        costs = perf.roofline.graph_costs(spec, 2, "bf16", graph["tokens"], 32)
        assert {k: graph[k] for k in costs} == costs
        assert graph["memory_ms"] == pytest.approx((costs["weight_bytes"] + costs["kv_bytes"])
                                                   / block["rates"]["memory_bytes_per_s"] * 1e3)
        assert graph["floor_ms"] == max(graph["memory_ms"], graph["compute_ms"])
        assert graph["measured_ms"] == measured[graph["graph"]]
        assert graph["host_side_ms"] == statistics.median(
            [c - g for c, g in zip(calls[graph["graph"]], inside[graph["graph"]])])
        assert graph["efficiency"] == pytest.approx(graph["floor_ms"] / measured[graph["graph"]])
    spread = block["rates_spread"]
    assert spread["memory_bytes_per_s"]["min"] <= block["rates"]["memory_bytes_per_s"] <= spread[
        "memory_bytes_per_s"]["max"] and spread["flops_per_s"]["n"] == perf.machine.MATMUL_REPEATS
    # measured once per process: the second bench of the module reports the same rates
    assert perf.load_result(bench_runs[0] / "b.json")["roofline"]["rates"] == block["rates"]
    text = perf_text.render_bench_summary(result)
    assert "efficiency" in text and f"{100 * block['graphs'][-1]['efficiency']:.1f}%" in text
    assert "graph ms" in text and "host-side ms" in text and "rates measured once" in text
    assert "ttft_ms" in text and "throughput" in text
    assert "| prefill[16] |" in perf_text.render_roofline_markdown(block)


def test_bench_pins_the_tokens_it_generated(bench_runs, tiny0_ckpt):
    """The outputs block holds each prompt's greedy tokens, equal to a plain greedy decode of the
    same prompt by a fresh engine, and both bench runs generated the same ones."""
    from harness.backends import build_engine

    a, b = (perf.load_result(bench_runs[0] / name)["outputs"] for name in ("a.json", "b.json"))
    assert [p["bucket"] for p in a["prompts"]] == [8, 16]
    assert [len(p["tokens"]) for p in a["prompts"]] == [1, NEW_TOKENS + 1]
    assert a["runs_agree"] and a["prompts"] == b["prompts"] and a["fingerprint"] == b["fingerprint"]
    engine = build_engine(tiny0_ckpt, RunSettings(backend="cpu", tp=2, dtype="bf16", buckets=(8, 16), kv_len=32))
    for prompt in a["prompts"]:
        ids = perf.bench_prompt(tiny0_ckpt.spec.vocab_size, prompt["bucket"])
        decoded = generate(engine, [ids], len(prompt["tokens"]))[0]
        assert decoded.tokens == prompt["tokens"]
        assert prompt["margins"] == pytest.approx([perf.outputs.argmax_margin(row) for row in decoded.step_logits])


def test_bench_history_holds_both_runs_and_compares(bench_runs, capsys):
    tmp, *_ = bench_runs
    files = sorted((tmp / "history").glob("*.json"))
    assert len(files) == 2
    assert [perf.load_result(f)["created"] for f in files] == [perf.load_result(tmp / n)["created"]
                                                               for n in ("a.json", "b.json")]
    # Three runs a side can never be significant at alpha 0.01, whatever the CPU's noise did.
    assert run_cli("perf", "compare", "--history", tmp / "history") == 0
    assert "too few runs" in capsys.readouterr().out


def test_perf_compare_accepts_bench_files_via_the_command(bench_runs):
    tmp, *_ = bench_runs
    out = tmp / "comparison.json"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "perf", "compare", "--baseline", tmp / "a.json",
                           "--current", tmp / "b.json", "--json", out, "--markdown", tmp / "perf.md"],
                          capture_output=True, text=True, timeout=900)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    comparison = json.loads(out.read_text())
    assert [m["metric"] for m in comparison["metrics"]] == ["prefill_ms", "prefill_ms[8]", "decode_ms_per_token"]
    assert comparison["failed"] is False
    assert "| decode_ms_per_token |" in (tmp / "perf.md").read_text()
    assert all(m["ci_low"] <= m["ratio"] <= m["ci_high"] and m["confidence"] == pytest.approx(0.98)
               for m in comparison["metrics"])
    assert "ratio 98% CI" in proc.stdout
    # the current run's floors and efficiency per graph, in all three outputs
    efficiency = [g["efficiency"] for g in perf.load_result(tmp / "b.json")["roofline"]["graphs"]]
    assert [g["efficiency"] for g in comparison["roofline"]["graphs"]] == efficiency
    markdown = (tmp / "perf.md").read_text()
    assert "Floors of the current run" in markdown and f"{100 * efficiency[-1]:.1f}%" in markdown
    assert "current run's floors" in proc.stdout


def test_bench_refuses_to_overwrite_out_without_force(bench_runs, tmp_path, capsys):
    out = tmp_path / "out.json"
    out.write_bytes((bench_runs[0] / "a.json").read_bytes())
    before = out.read_bytes()
    assert run_cli("bench", *BENCH_ARGS, "--out", out) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert run_cli("bench", *BENCH_ARGS, "--runs", 1, "--warmup", 0, "--out", out, "--force") == 0
    assert len(perf.load_result(out)["metrics"]["prefill_ms"]) == 1


def test_bench_rejects_a_cache_too_short_for_the_decode_steps():
    with pytest.raises(HarnessInputError, match="exceed the KV length 32"):
        perf.run_bench(Checkpoint.open(tiny_checkpoint(seed=0)), RunSettings(buckets=(16,), kv_len=32),
                       new_tokens=17, progress=False)


def test_bench_arguments_are_validated_by_argparse(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--model", "tiny", "--buckets", "16,x", "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        cli_main(["bench", "--out", str(tmp_path / "x.json")])  # neither --checkpoint nor --model
