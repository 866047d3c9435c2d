"""Latency at length: TTFT against prompt length (prompts longer than the largest bucket go through
the chunked prefill) and TPOT against context length (decode steps continuing each of those prompts),
each length with its modelled floor at the KV buckets its calls read (context.py on the same rates as
the bench's per-graph floors).

Compared metrics, one pair per length L: `ttft_ms@L` (one sample per run) and `tpot_ms@L` (per run,
the mean ms of the decode steps from position L). The tokens each length generated are pinned like
the bench prompts' (outputs.py), in their own block, so results without lengths stay comparable.
"""

from __future__ import annotations

import statistics

from harness.base.errors import HarnessInputError
from harness.inputs.prompts import kv_positions_used
from harness.perf import outputs
from harness.perf.context import context_floors
from harness.perf.timing import timed_generate

from harness.perf.samples import length_samples  # noqa: F401  (re-exported)


def parse_lengths(text: str) -> tuple[int, ...]:
    """"16,64,200" -> (16, 64, 200), ascending and without repeats."""
    try:
        lengths = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        raise HarnessInputError(f"--lengths {text!r}: give positive prompt lengths separated by commas, e.g. 16,64,200")
    return tuple(lengths)


def check_lengths(lengths, new_tokens: int, kv_len: int) -> None:
    if lengths and kv_positions_used(max(lengths), new_tokens + 1) > kv_len:  # the prefill's token, then the steps
        raise HarnessInputError(f"--lengths {max(lengths)} + {new_tokens} new tokens exceed the KV length {kv_len}; "
                                f"use --kv-len {max(lengths) + new_tokens}, shorter lengths or fewer --new-tokens")


def _length_run(engine, prompts: dict[int, list[int]], new_tokens: int) -> dict[int, dict]:
    """Per length, one run of the one decode loop (the prompt, chunked when it is longer than the
    largest bucket, then `new_tokens` decode steps), timed through its hooks (timing.py)."""
    run = {}
    for n in sorted(prompts):
        (result,), times = timed_generate(engine, [prompts[n]], new_tokens + 1)
        run[n] = {"ttft": times.ttft_ms(), "steps": times.step_ms(), "tokens": result.tokens,
                  "margins": [outputs.argmax_margin(row) for row in result.step_logits]}
    return run


def measure_at_length(engine, prompts: dict[int, list[int]], *, runs: int, warmup: int, new_tokens: int,
                      show=lambda _msg: None) -> dict:
    """The timed samples per length, after `warmup` discarded runs, and the pinned outputs."""
    for k in range(warmup):
        show(f"at length: warm-up {k + 1}/{warmup}")
        _length_run(engine, prompts, new_tokens)
    timed = []
    for k in range(runs):
        timed.append(_length_run(engine, prompts, new_tokens))
        show(f"at length: run {k + 1}/{runs}: " + ", ".join(
            f"TTFT@{n} {r['ttft']:.1f} ms" for n, r in timed[-1].items()))
    rows = [{"length": n, "ttft_ms": [run[n]["ttft"] for run in timed],
             "tpot_ms": [statistics.fmean(run[n]["steps"]) for run in timed],
             "tpot_steps_ms": [run[n]["steps"] for run in timed]} for n in sorted(prompts)]
    pinned = outputs.record([[{"length": n, "tokens": r["tokens"], "margins": r["margins"]}
                              for n, r in sorted(run.items())] for run in timed])
    return {"new_tokens": new_tokens, "lengths": rows, "outputs": pinned}


def add_floors(block: dict, spec, result: dict, rates, *, sliding_cache: str) -> dict:
    """Each length's TTFT floor (its chunks, each at its KV bucket) and TPOT floor (the decode step at
    position L, at its KV bucket), from context.py, beside the measured medians."""
    settings = result["settings"]
    block["sliding_cache"] = sliding_cache
    for row in block["lengths"]:
        floor = context_floors(spec, result["tp"], result["dtype"], row["length"], buckets=settings["buckets"],
                               max_len=settings["kv_len"], rates=rates,
                               sliding_cache=sliding_cache)
        row["floor"] = {k: floor[k] for k in ("ttft_ms", "tpot_ms", "tpot_bound", "decode_kv_bucket")}
        row["ttft_p50_ms"] = statistics.median(row["ttft_ms"])
        row["tpot_p50_ms"] = statistics.median(row["tpot_ms"])
    return block


def pin_length_outputs(baseline: dict, current: dict, labels: tuple[str, str]) -> tuple[str | None, list[str]]:
    """outputs.compare_outputs on the lengths' pinned tokens, when both results have them."""
    if "at_length" not in baseline or "at_length" not in current:
        return None, []
    sides = [{k: v for k, v in r["at_length"].items() if k == "outputs"} for r in (baseline, current)]
    refusal, notes = outputs.compare_outputs(*sides, *labels)
    lengths = [r["length"] for r in current["at_length"]["lengths"]]
    where = f"at length (prompts {', '.join(map(str, lengths))}): "
    return (None if refusal is None else where + refusal), [where + n for n in notes]
