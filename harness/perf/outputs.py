"""Benchmarks pin their outputs: the tokens each timed run generated and a fingerprint of how firmly
each was chosen, so that `perf compare` never calls a run faster or slower when it computed
something else (an optimisation that changes the output is not a performance result; MLPerf's
audit test TEST01 makes the same demand of a performance run).

Per bench prompt k (the prompt of bucket k in ascending bucket order), the recorded outputs are the
greedy tokens (the first from the prefill, then one per decode step for the headline prompt) and
each step's argmax margin (top-1 minus top-2 raw logit). Tokens decide; the margins' fingerprint
only tells whether the numbers under the same tokens moved.
"""

from __future__ import annotations

import hashlib
import json

from harness.base.errors import HarnessInputError

MARGIN_DECIMALS = 4  # the fingerprint's resolution: margins are raw logits, O(1)-O(10)


def argmax_margin(logits) -> float:
    """Top-1 minus top-2 of one raw logits row (0.0 for a one-entry row)."""
    if logits.numel() < 2:
        return 0.0
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def fingerprint(prompts: list[dict]) -> str:
    margins = [[round(m, MARGIN_DECIMALS) for m in p["margins"]] for p in prompts]
    return hashlib.sha256(json.dumps(margins).encode()).hexdigest()[:16]


def record(run_outputs: list[list[dict]]) -> dict:
    """The outputs block of a bench result from every timed run's outputs (a list, per run, of
    {"bucket", "tokens", "margins"} per prompt): the first run's, and whether every run agreed."""
    first = run_outputs[0]
    block = {"prompts": first, "fingerprint": fingerprint(first), "runs_agree": True}
    for r, run in enumerate(run_outputs[1:], start=2):
        where = first_difference(first, run)
        if where is not None:
            block["runs_agree"] = False
            block["runs_differ"] = f"run {r} differs from run 1 at prompt {where[0]} step {where[1]}"
            break
    return block


def first_difference(baseline: list[dict], current: list[dict]) -> tuple[int, int] | None:
    """(prompt k, step s) of the first token that differs (a missing token counts), or None."""
    for k in range(max(len(baseline), len(current))):
        if k >= len(baseline) or k >= len(current):
            return k, 0
        old, new = baseline[k]["tokens"], current[k]["tokens"]
        for s in range(max(len(old), len(new))):
            if s >= len(old) or s >= len(new) or old[s] != new[s]:
                return k, s
    return None


def _valid(block, source: str) -> list[dict]:
    prompts = block.get("prompts") if isinstance(block, dict) else None
    ok = isinstance(prompts, list) and all(
        isinstance(p, dict) and isinstance(p.get("tokens"), list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in p["tokens"]) for p in prompts)
    if not ok:
        raise HarnessInputError(f"{source}: outputs.prompts must be a list of {{\"tokens\": [int, ...]}}; the "
                                "file is corrupted or was edited: re-run the benchmark")
    return prompts


def compare_outputs(baseline: dict, current: dict, baseline_label: str = "baseline",
                    current_label: str = "current") -> tuple[str | None, list[str]]:
    """(the refusal, or None when the outputs agree or were not recorded; notes to print)."""
    notes = []
    sides = ((baseline_label, baseline), (current_label, current))
    missing = [label for label, r in sides if "outputs" not in r]
    recorded = {label: _valid(r["outputs"], label) for label, r in sides if "outputs" in r}
    for label, r in sides:
        if label in recorded and r["outputs"].get("runs_agree", True) is not True:
            notes.append(f"outputs of {label} varied between its runs: {r['outputs'].get('runs_differ')}")
    if missing:
        return None, notes + [f"outputs not recorded in {', '.join(missing)} (written before bench pinned its "
                              "outputs): the timings are compared without checking that the outputs agree"]
    old, new = recorded[baseline_label], recorded[current_label]
    where = first_difference(old, new)
    if where is not None:
        k, s = where
        return (f"outputs changed at prompt {k} step {s}: {current_label} generated other tokens than "
                f"{baseline_label} ({_token(old, k, s)} -> {_token(new, k, s)}); a run that computes something "
                "else is not a performance result. Pass --allow-output-change to compare the timings anyway"), notes
    if baseline["outputs"].get("fingerprint") != current["outputs"].get("fingerprint"):
        notes.append("outputs: the same tokens, but the argmax margins moved (fingerprint "
                     f"{baseline['outputs'].get('fingerprint')} -> {current['outputs'].get('fingerprint')})")
    else:
        notes.append("outputs: the same tokens and argmax margins as the baseline")
    return None, notes


def _token(prompts: list[dict], k: int, s: int) -> str:
    tokens = prompts[k]["tokens"] if k < len(prompts) else []
    return str(tokens[s]) if s < len(tokens) else "none"
