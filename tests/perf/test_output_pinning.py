"""Benchmarks pin their outputs: `bench` records the tokens each prompt generated (and a
fingerprint of the argmax margins), and `perf compare` refuses to call a run faster or slower when
its tokens differ from the baseline's, unless --allow-output-change. Results written before the
outputs were recorded are compared with a note, never refused."""

from __future__ import annotations

import copy
import json
import random

import pytest

from harness import perf
from harness.cli import main as cli_main
from harness.perf import outputs

from tests.perf.test_perf_regression import samples, synthetic_result


def with_outputs(result: dict, tokens: list[list[int]], margins: list[list[float]] | None = None) -> dict:
    prompts = [{"bucket": 16 * (k + 1), "tokens": t, "margins": (margins or [[1.0] * len(t) for t in tokens])[k]}
               for k, t in enumerate(tokens)]
    result["outputs"] = {"prompts": prompts, "fingerprint": outputs.fingerprint(prompts), "runs_agree": True}
    return result


def pair(tmp_path, base_tokens, cur_tokens, base_margins=None, cur_margins=None):
    """Two results with the same timings (so no timing verdict could fail) and the given outputs."""
    rng = random.Random(0)
    prefill, decode = samples(rng, 100, 0.02), samples(rng, 30, 0.02)
    base = with_outputs(synthetic_result(prefill, decode), base_tokens, base_margins)
    # the current run is 30% faster: a real speed-up, if the outputs agreed
    cur = with_outputs(synthetic_result([x * 0.7 for x in prefill], [x * 0.7 for x in decode]), cur_tokens,
                       cur_margins)
    paths = tmp_path / "base.json", tmp_path / "cur.json"
    for path, result in zip(paths, (base, cur)):
        path.write_text(json.dumps(result))
    return paths


def compare(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = cli_main(["perf", "compare", *map(str, argv)])
    return code, capsys.readouterr().out


def test_changed_tokens_fail_the_comparison_naming_where(tmp_path, capsys):
    base, cur = pair(tmp_path, [[5], [7, 8, 9, 10]], [[5], [7, 8, 11, 10]])
    code, out = compare(capsys, "--baseline", base, "--current", cur, "--json", tmp_path / "c.json")
    assert code == 1
    assert "outputs changed at prompt 1 step 2" in out and "9 -> 11" in out
    assert "perf: FAILED (outputs changed at prompt 1 step 2)" in out
    payload = json.loads((tmp_path / "c.json").read_text())
    assert payload["failed"] and payload["output_change"].startswith("outputs changed at prompt 1 step 2")
    # no metric is called faster: the timings of runs that computed different things are not compared
    assert all(not m["improved"] and m["verdict"] == "not compared: the outputs changed" for m in payload["metrics"])


def test_allow_output_change_compares_the_timings_and_says_what_changed(tmp_path, capsys):
    base, cur = pair(tmp_path, [[5], [7, 8, 9, 10]], [[5], [7, 8, 11, 10]])
    code, out = compare(capsys, "--baseline", base, "--current", cur, "--allow-output-change")
    assert code == 0
    assert "outputs changed at prompt 1 step 2" in out and "allowed by --allow-output-change" in out
    comp = perf.compare_files(base, cur, allow_output_change=True, intervals=False)
    assert comp.output_change is None and {m.verdict for m in comp.metrics} == {"faster"}


@pytest.mark.parametrize("base_tokens, cur_tokens, where", [
    ([[5], [7, 8]], [[6], [7, 8]], (0, 0)),      # the first prompt's first token
    ([[5], [7, 8]], [[5], [7]], (1, 1)),         # a token missing at the end
    ([[5], [7, 8]], [[5]], (1, 0)),              # a prompt missing
    ([[5], [7, 8]], [[5], [7, 8]], None),
])
def test_first_difference(base_tokens, cur_tokens, where):
    as_prompts = lambda tokens: [{"tokens": t} for t in tokens]  # noqa: E731
    assert outputs.first_difference(as_prompts(base_tokens), as_prompts(cur_tokens)) == where


def test_same_tokens_with_moved_margins_are_compared_with_a_note(tmp_path, capsys):
    base, cur = pair(tmp_path, [[5], [7, 8]], [[5], [7, 8]], [[1.0], [2.0, 3.0]], [[1.0], [2.0, 3.5]])
    code, out = compare(capsys, "--baseline", base, "--current", cur)
    assert code == 0 and "the argmax margins moved" in out
    base, cur = pair(tmp_path, [[5], [7, 8]], [[5], [7, 8]])
    code, out = compare(capsys, "--baseline", base, "--current", cur)
    assert code == 0 and "the same tokens and argmax margins" in out


def test_results_without_outputs_are_compared_with_a_note(tmp_path, capsys):
    base, cur = pair(tmp_path, [[5]], [[6]])
    old = json.loads(base.read_text())
    del old["outputs"]
    base.write_text(json.dumps(old))
    code, out = compare(capsys, "--baseline", base, "--current", cur)
    assert code == 0 and f"outputs not recorded in {base}" in out


def test_a_history_whose_newest_run_changed_its_outputs_fails(tmp_path, capsys):
    rng = random.Random(1)
    for i, tokens in enumerate(([3, 4], [3, 4], [3, 4], [3, 9])):
        result = synthetic_result(samples(rng, 100, 0.02), samples(rng, 30, 0.02),
                                  created=f"2026-01-01T00:{i:02d}:00+00:00", commit=f"c{i}")
        perf.append_history(with_outputs(result, [tokens]), tmp_path)
    code, out = compare(capsys, "--history", tmp_path)
    assert code == 1 and "outputs changed at prompt 0 step 1" in out
    code, _ = compare(capsys, "--history", tmp_path, "--allow-output-change")
    assert code == 0


def test_a_malformed_outputs_block_is_bad_input(tmp_path, capsys):
    base, cur = pair(tmp_path, [[5]], [[5]])
    broken = json.loads(cur.read_text())
    broken["outputs"]["prompts"] = [{"tokens": ["x"]}]
    cur.write_text(json.dumps(broken))
    code = cli_main(["perf", "compare", "--baseline", str(base), "--current", str(cur)])
    assert code == 2 and "outputs.prompts" in capsys.readouterr().err


def test_record_notes_runs_that_disagree():
    run = [{"bucket": 16, "tokens": [1, 2], "margins": [0.5, 0.25]}]
    other = copy.deepcopy(run)
    other[0]["tokens"][1] = 3
    assert outputs.record([run, run])["runs_agree"] is True
    block = outputs.record([run, run, other])
    assert block["runs_agree"] is False and block["runs_differ"] == "run 3 differs from run 1 at prompt 0 step 1"
    assert block["prompts"] == run and block["fingerprint"] == outputs.fingerprint(run)
