"""Performance per batch size: the roofline of a batched decode step and prefill, and `bench --batch`
(tokens/s, per-token latency and prefill per batch bucket, each against its floor). Whether a
batch's KV slots fit is planned in harness/plan/batch_fit.py.

A decode step of b sequences reads the weights once and each sequence's KV slot: throughput grows
nearly linearly with b until the KV reads (b x kv bytes) or the compute (b x the FLOPs of a token)
bind.
"""

from __future__ import annotations

import statistics

from harness.base.errors import HarnessInputError
from harness.inputs.spec import ModelSpec
from harness.perf.roofline import Rates, floors, graph_costs, lm_head_params_per_rank
from harness.perf.timing import timed_generate
from harness.port.sharding import bytes_per_rank


def batch_costs(spec: ModelSpec, tp: int, dtype: str, batch: int, tokens: int, kv_len: int) -> dict:
    """One call of `batch` rows of `tokens` tokens each: the weights read once (the experts the
    batch's tokens use), every row's KV slot read and written, every row's FLOPs and lm_head."""
    costs = graph_costs(spec, tp, dtype, batch * tokens, kv_len)  # weights once, one KV slot, all rows' FLOPs
    kv_slot = tp * bytes_per_rank(spec, tp, dtype, kv_len)["kv_cache"]
    costs["kv_bytes"] += (batch - 1) * kv_slot
    costs["flops"] += (batch - 1) * tp * 2 * lm_head_params_per_rank(spec, tp)  # each row's last position
    return {**costs, "batch": batch, "tokens": tokens}


def batch_floors(spec: ModelSpec, tp: int, dtype: str, batches, kv_len: int, rates: Rates, buckets=()) -> list[dict]:
    """Per batch size: the decode step's floor and the throughput it allows, and prefill per bucket."""
    rows = []
    for b in batches:
        for name, tokens in [(f"prefill[{bucket}]", bucket) for bucket in sorted(buckets)] + [("decode", 1)]:
            costs = batch_costs(spec, tp, dtype, b, tokens=tokens, kv_len=kv_len)
            row = {"graph": name, "batch": b, **costs, **floors(costs, rates)}
            if name == "decode":
                row["tokens_per_s_floor"] = b / row["floor_ms"] * 1e3
            rows.append(row)
    return rows


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def time_batch(engine, prompts: list[list[int]], new_tokens: int, runs: int) -> dict:
    """`runs` timed runs of one batch through the one decode loop (timing.py): every prompt
    admitted at once (a KV slot each, prefilled in one batched call per chunk), then `new_tokens`
    tokens of all of them. Medians of the prefill and the per-step latency (a step ends when its
    last row's token is out), tokens per second (rows / step), and the tokens each row generated
    (pinned outputs)."""
    prefill, steps, tokens = [], [], None
    for _ in range(runs):
        results, times = timed_generate(engine, prompts, new_tokens)
        prefill.append(max(times.prefill_ms(k) for k in range(len(prompts))) / 1e3)
        ends = times.last_ms()
        steps += [(b - a) / 1e3 for a, b in zip(ends, ends[1:])]
        out = [r.tokens for r in results]
        if tokens is not None and tokens != out:
            raise RuntimeError("a batch generated different tokens in two runs of the same inputs")
        tokens = out
    step_ms = _median_ms(steps) if steps else None
    return {"batch": len(prompts), "prefill_ms": _median_ms(prefill), "step_ms": step_ms,
            "tokens_per_s": len(prompts) / step_ms * 1e3 if step_ms else None, "tokens": tokens,
            "prefill_samples_ms": [s * 1e3 for s in prefill], "step_samples_ms": [s * 1e3 for s in steps]}


def with_batch_efficiency(measured: list[dict], floor_rows: list[dict]) -> list[dict]:
    """Each measured batch beside its decode floor: efficiency = floor / measured step."""
    by_batch = {r["batch"]: r for r in floor_rows if r["graph"] == "decode"}
    out = []
    for m in measured:
        floor = by_batch[m["batch"]]
        out.append({**m, "step_floor_ms": floor["floor_ms"], "bound": floor["bound"],
                    "tokens_per_s_floor": floor["tokens_per_s_floor"],
                    "efficiency": floor["floor_ms"] / m["step_ms"] if m["step_ms"] else None})
    return out


def run_batch_bench(checkpoint, settings, batches, runs: int, new_tokens: int, prompt_len: int,
                    assistant=None) -> dict:
    """`bench --batch`: one build with max(batches) KV slots; per batch size, `runs` timed runs of
    that many prompts of `prompt_len` tokens, beside the floors on this backend's rates; with
    `assistant` (the opened settings.assistant), each batch decoded speculatively too."""
    from harness.perf.bench import bench_prompt, bench_rates, perf_engine

    batches = sorted(set(batches))
    # the batched perf build (no captures), made as bench makes its own: the loop's opening reset
    # zeroes no cache on neuron (a reused slot needs none), so it stays out of the timed prefill
    engine = perf_engine(checkpoint, settings.but(batch=batches[-1]), assistant=assistant)
    spec = checkpoint.spec
    prompts = {b: [bench_prompt(spec.vocab_size, prompt_len, seed=k) for k in range(b)] for b in batches}
    measured = [time_batch(engine, prompts[b], new_tokens, runs) for b in batches]
    if assistant is not None:  # --speculate K: each batch decoded speculatively too (accepted drafts per verify)
        from harness.backends import build_drafter
        from harness.perf.speculative import time_speculative_batch

        drafter = build_drafter(engine, assistant)
        for row, b in zip(measured, batches):
            row["speculative"] = time_speculative_batch(engine, drafter, prompts[b], new_tokens, k=settings.speculate,
                                                       runs=runs)
    rates, _ = bench_rates(settings.backend, settings.tp, settings.dtype)
    floor_rows = batch_floors(spec, settings.tp, settings.dtype, batches, settings.kv_len, rates=rates,
                              buckets=[b for b in settings.buckets if b >= prompt_len][:1])
    return {"batches": batches, "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs,
            "rows": with_batch_efficiency(measured, floor_rows), "floors": floor_rows, "rates": rates.to_dict()}


# A decode step of B rows on the device: within this many times its floor on the instance (the
# weights read once and every row's KV at the chip's rates), as compare.BUDGETS' tpot_ms is 2x
# the batch-1 step's weight-read floor.
BATCH_BUDGET_FACTOR = 2.0


def batch_budgets(result: dict, factor: float = BATCH_BUDGET_FACTOR) -> dict[str, float]:
    """`step_ms@b{B}` -> an absolute ceiling in ms per batch size of a `bench --batch` result:
    `factor` x that batch's decode floor on the rates the bench recorded (the instance's, on inf2).
    Checked with compare.check_budgets on samples.budget_samples (tests/perf/test_device_budgets.py)."""
    rows = (result.get("batch") or {}).get("rows") or []
    if not rows:
        raise HarnessInputError("this bench result has no batch block: run `gemma-parity bench --batch 1,2,4,8`")
    return {f"step_ms@b{r['batch']}": factor * r["step_floor_ms"] for r in rows if r.get("step_samples_ms")}


def pin_batch_outputs(baseline: dict, current: dict, labels: tuple[str, str]) -> tuple[str | None, list[str]]:
    """(a refusal when a batch size both results timed generated other tokens in some row, else
    None; notes): a batch that computes something else is not a performance result."""
    old = {r["batch"]: r.get("tokens") for r in (baseline.get("batch") or {}).get("rows", [])}
    new = {r["batch"]: r.get("tokens") for r in (current.get("batch") or {}).get("rows", [])}
    for b in sorted(set(old) & set(new)):
        if old[b] is None or new[b] is None or old[b] == new[b]:
            continue
        row = next(k for k, (x, y) in enumerate(zip(old[b], new[b])) if x != y) if len(old[b]) == len(new[b]) else 0
        return (f"outputs changed at batch {b} row {row}: {labels[1]} generated other tokens than {labels[0]} "
                f"({old[b][row] if row < len(old[b]) else None} -> {new[b][row] if row < len(new[b]) else None}); "
                "a run that computes something else is not a performance result. Pass --allow-output-change "
                "to compare the timings anyway"), []
    shared = sorted(set(old) & set(new))
    return None, ([f"batch outputs: the same tokens per row at batch {', '.join(map(str, shared))}"] if shared else [])
