"""Performance per batch size (issue 29): the KV fit of a batch, the roofline of a batched decode
step and prefill, and `bench --batch` (tokens/s, per-token latency and prefill per batch bucket,
each against its floor).

A decode step of b sequences reads the weights once and each sequence's KV slot: throughput grows
nearly linearly with b until the KV reads (b x kv bytes) or the compute (b x the FLOPs of a token)
bind. A batch needs b KV slots beside the weights: `batch_fit` says whether they fit the HBM.
"""

from __future__ import annotations

import statistics
import time

from harness.base.errors import HarnessInputError
from harness.inputs.spec import ModelSpec
from harness.perf.roofline import CHIP, GiB, Rates, floors, graph_costs, lm_head_params_per_rank
from harness.port.sharding import bytes_per_rank


def batch_fit(spec: ModelSpec, tp: int, dtype: str, batch: int, kv_len: int, chip: dict | None = None,
              sliding_cache: str = "linear", buckets=None) -> dict:
    """A perf build of `batch` KV slots of `kv_len` (what serves a batch) by the one device fit
    (instances.core_bytes: weights, the slots' KV, every batch bucket's graphs, the MoE working set) against each core's HBM (the
    chip's split over its cores), summed over the TP group; `max_batch` the most slots that fit at
    this KV length by the same fit (what the memory plan prints too)."""
    from harness.base.settings import DEFAULT_BUCKETS
    from harness.perf.instances import core_bytes

    chip = chip or CHIP
    per_core = chip["hbm_bytes"] / chip["cores"]
    build = dict(buckets=buckets or DEFAULT_BUCKETS, perf=True)  # what serves a batch: the perf build

    def core(slots: int) -> dict:
        return core_bytes(spec, tp, dtype, kv_len, sliding_cache, **build, batch=slots)

    this = core(batch)
    most = 0
    while most < 256 and core(most + 1)["total"] <= per_core:
        most += 1
    kv_one = core_bytes(spec, tp, dtype, kv_len, sliding_cache, **build)["kv_cache"]
    return {"batch": batch, "kv_len": kv_len, "weights_bytes": tp * this["weights"], "kv_bytes_per_sequence": tp * kv_one,
            "kv_bytes": tp * this["kv_cache"], "graphs_bytes": tp * (this["graph_bytes"] + this["moe_working_set"]),
            "graphs": this["graphs"], "needed_bytes": tp * this["total"], "capacity_bytes": tp * per_core,
            "fits": this["total"] <= per_core, "max_batch": most}


def fit_table(spec: ModelSpec, tp: int, dtype: str, batches, kv_lens, chip: dict | None = None,
              sliding_cache: str = "linear") -> list[dict]:
    """batch_fit of every batch size at every KV length."""
    return [batch_fit(spec, tp, dtype, b, n, chip=chip, sliding_cache=sliding_cache) for n in kv_lens for b in batches]


def refuse_unfit_batch(fit: dict) -> None:
    """Bad input (naming the numbers) when a batch's KV slots do not fit beside the weights."""
    if not fit["fits"]:
        raise HarnessInputError(
            f"--batch {fit['batch']} at --kv-len {fit['kv_len']}: weights {fit['weights_bytes'] / GiB:.2f} GiB + "
            f"{fit['batch']} x {fit['kv_bytes_per_sequence'] / GiB:.3f} GiB of KV + {fit['graphs']} graphs "
            f"{fit['graphs_bytes'] / GiB:.2f} GiB = {fit['needed_bytes'] / GiB:.2f} GiB, "
            f"more than the {fit['capacity_bytes'] / GiB:.0f} GiB of HBM; at most {fit['max_batch']} sequences fit "
            "at this KV length (lower --batch or --kv-len)")


def render_fit_table(rows: list[dict]) -> str:
    lines = ["batch fit (the device fit: weights + batch x KV slot + every batch bucket's graphs, against HBM):",
             f"  {'kv_len':>8} {'batch':>5} {'KV/seq GiB':>10} {'KV GiB':>8} {'graphs GiB':>10} {'total GiB':>9} "
             f"{'of GiB':>6}  fit"]
    for r in rows:
        lines.append(f"  {r['kv_len']:>8} {r['batch']:>5} {r['kv_bytes_per_sequence'] / GiB:>10.3f} "
                     f"{r['kv_bytes'] / GiB:>8.2f} {r['graphs_bytes'] / GiB:>10.2f} {r['needed_bytes'] / GiB:>9.2f} "
                     f"{r['capacity_bytes'] / GiB:>6.0f}  "
                     f"{'yes' if r['fits'] else 'NO'} (at most {r['max_batch']})")
    return "\n".join(lines) + "\n"


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


def time_batch(batch_engine, prompts: list[list[int]], new_tokens: int, runs: int) -> dict:
    """`runs` timed runs of one batch: prefill of every prompt in one batched call per chunk, then
    `new_tokens` decode steps of all of them. Medians of the prefill and the per-step latency,
    tokens per second (rows / step), and the tokens each row generated (pinned outputs)."""
    prefill, steps, tokens = [], [], None
    slots = list(range(len(prompts)))
    for _ in range(runs):
        batch_engine.backend.reset()
        start = time.perf_counter()
        pres = batch_engine.prefill(prompts, slots)
        prefill.append(time.perf_counter() - start)
        fed = [int(p.logits[-1].argmax()) for p in pres]
        out = [[t] for t in fed]
        for step in range(new_tokens - 1):
            start = time.perf_counter()
            results = batch_engine.decode(fed, [len(p) + step for p in prompts], slots)
            steps.append(time.perf_counter() - start)
            fed = [int(r.logits.argmax()) for r in results]
            for row, t in zip(out, fed):
                row.append(t)
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


def run_batch_bench(checkpoint, settings, batches, runs: int, new_tokens: int, prompt_len: int) -> dict:
    """`bench --batch`: one build with max(batches) KV slots; per batch size, `runs` timed runs of
    that many prompts of `prompt_len` tokens, beside the floors on this backend's rates."""
    from harness.backends import build_engine
    from harness.perf.bench import bench_prompt, bench_rates
    from harness.port.batching import BatchEngine

    batches = sorted(set(batches))
    # the batched perf build (every row's logits, no captures), on every backend
    engine = build_engine(checkpoint, settings.but(batch=batches[-1]))
    be = BatchEngine(engine)
    spec = checkpoint.spec
    prompts = {b: [bench_prompt(spec.vocab_size, prompt_len, seed=k) for k in range(b)] for b in batches}
    measured = [time_batch(be, prompts[b], new_tokens, runs) for b in batches]
    if settings.assistant:  # --speculate K: each batch decoded speculatively too (accepted drafts per verify)
        from harness.backends import build_drafter
        from harness.inputs.assistant_checkpoint import AssistantCheckpoint
        from harness.perf.speculative import time_speculative_batch

        drafter = build_drafter(engine, AssistantCheckpoint.open(settings.assistant, spec))
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
    Checked with compare.check_budgets on results.budget_samples (tests/perf/test_device_budgets.py)."""
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
