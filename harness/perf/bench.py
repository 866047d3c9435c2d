"""The benchmark runner: timed prefill per bucket and greedy decode steps, with the latency
vocabulary (TTFT, TPOT, end-to-end, throughput) and the roofline floors of every graph.

  TTFT    one prefill of the bucket as a user waits for it: host embedding, the device graph, the
          logits back on the host, and the first token (argmax of the last position's logits).
  TPOT    one decode step: embed the fed-back token, the decode graph, argmax.
  E2E     the headline bucket's prompt to its last token: TTFT plus new_tokens decode steps
          (new_tokens + 1 tokens generated).

Every figure is of the one decode loop (harness/port/decode.py), timed through its hooks
(harness/perf/timing.py): bench keeps no prefill or decode loop of its own.
"""

from __future__ import annotations

import functools
import random
import statistics
from datetime import datetime, timezone

from harness.base.errors import HarnessInputError
from harness.base.progress import status
from harness.base.settings import PUBLISHED_BUCKET, RunSettings
from harness.inputs.prompts import kv_positions_used
from harness.perf import length, machine, outputs
from harness.perf.results import FORMAT
from harness.perf.samples import latency_samples, metric_samples
from harness.perf.roofline import measured_rates, neuron_instance_rates, roofline_block
from harness.perf.stats import summarize
from harness.perf.timing import timed_generate

DEFAULT_RUNS, DEFAULT_WARMUP, DEFAULT_NEW_TOKENS = 20, 3, 16
# What bench runs unless told: the published port's prefill bucket (the one its figure was measured at).
BENCH_SETTINGS = RunSettings(buckets=(PUBLISHED_BUCKET,))


def bench_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt that fills a bucket (ids 0-2 are pad/eos/bos: avoided)."""
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def _bench_run(engine, prompts: dict[int, list[int]], headline: int, new_tokens: int) -> dict:
    """One run of the one decode loop per bucket (the headline bucket last): each prompt's prefill,
    and on the headline prompt `new_tokens` greedy decode steps after it, timed through the loop's
    hooks (harness/perf/timing.py). The logits rows are kept and their argmax margins computed after
    the timed regions."""
    run = {"prefill_ms": {}, "ttft_ms": {}, "prefill_graph_ms": {}, "tokens": {}}
    rows = {}
    for bucket in sorted(prompts, key=lambda b: b == headline):
        (result,), times = timed_generate(engine, [prompts[bucket]], 1 + (new_tokens if bucket == headline else 0))
        run["prefill_ms"][bucket], run["ttft_ms"][bucket] = times.prefill_ms(), times.ttft_ms()
        run["prefill_graph_ms"][bucket] = times.prefill_graph_ms()
        rows[bucket], run["tokens"][bucket] = result.step_logits, result.tokens
    run["steps"], run["step_graph_ms"], run["e2e_ms"] = times.step_ms(), times.step_graph_ms(), times.e2e_ms()
    run["outputs"] = [{"bucket": b, "tokens": run["tokens"][b], "margins": [outputs.argmax_margin(r) for r in rows[b]]}
                      for b in sorted(prompts)]
    return run


def _check_bench_options(runs, warmup, buckets, new_tokens, kv_len) -> None:
    if runs < 1 or warmup < 0 or new_tokens < 1:
        raise HarnessInputError(f"--runs {runs}, --warmup {warmup}, --new-tokens {new_tokens}: need "
                                "runs >= 1, warmup >= 0 and new tokens >= 1")
    if not buckets or min(buckets) < 1:
        raise HarnessInputError(f"--buckets {buckets}: give positive bucket sizes, e.g. 16,64")
    if kv_positions_used(max(buckets), new_tokens + 1) > kv_len:  # the prefill's token, then new_tokens steps
        raise HarnessInputError(f"bucket {max(buckets)} + {new_tokens} new tokens exceed the KV length "
                                f"{kv_len}; use fewer --new-tokens or a smaller bucket")


def perf_engine(checkpoint, settings: RunSettings, assistant=None):
    """The perf build `bench` times and serving runs: no capture outputs (on a compiled backend its
    prefill graphs return only the last real row). `check` judges this same build
    (harness/parity/served.py), so what is timed is what is judged. `assistant`: the opened
    settings.assistant (harness.backends.build_engine)."""
    from harness.backends import build_engine

    if settings.backend == "neuron":
        # Stale cache slots are never read (causal mask): keep the 44 MB/rank zeroing of the KV
        # cache out of the timed prefill, as a serving loop would.
        settings = settings.but(backend_options={"zero_on_reset": False, **settings.backend_options})
    return build_engine(checkpoint, settings, assistant=assistant)


def run_bench(checkpoint, settings: RunSettings = BENCH_SETTINGS, runs: int = DEFAULT_RUNS,
              warmup: int = DEFAULT_WARMUP, new_tokens: int = DEFAULT_NEW_TOKENS, progress: bool = True,
              lengths=()) -> dict:
    """Time `runs` prefills per bucket and `runs` x `new_tokens` decode steps after `warmup`
    discarded runs, on a perf build made as `settings` say. Each decode_ms_per_token sample is one
    run's mean ms per token. `lengths` adds TTFT and TPOT at those prompt lengths (length.py)."""

    backend, tp, buckets, kv_len = settings.backend, settings.tp, settings.buckets, settings.kv_len
    _check_bench_options(runs, warmup, buckets, new_tokens, kv_len)
    length.check_lengths(lengths, new_tokens, kv_len)
    dtype = settings.short_dtype
    show = status("bench", progress)
    show(f"building the {backend} engine (tp {tp}, {dtype}, buckets {list(buckets)})"
         + ("; a first compile takes many minutes" if backend == "neuron" else ""))
    if backend == "neuron":
        bench_rates(backend, tp, dtype)  # an instance type without known rates fails here, before the build
    engine = perf_engine(checkpoint, settings)
    headline = PUBLISHED_BUCKET if PUBLISHED_BUCKET in buckets else max(buckets)
    prompts = {b: bench_prompt(checkpoint.spec.vocab_size, b) for b in buckets}
    for k in range(warmup):
        show(f"warm-up {k + 1}/{warmup}")
        _bench_run(engine, prompts, headline, new_tokens)
    timed = []
    for k in range(runs):
        timed.append(_bench_run(engine, prompts, headline, new_tokens))
        last = timed[-1]
        show(f"run {k + 1}/{runs}: TTFT[{headline}] {last['ttft_ms'][headline]:.1f} ms, "
             f"TPOT {statistics.fmean(last['steps']):.1f} ms, E2E {last['e2e_ms']:.1f} ms")
    timings = _collect(timed, buckets)
    settings = {"runs": runs, "warmup": warmup, "buckets": list(buckets), "new_tokens": new_tokens,
                "kv_len": kv_len}
    result = _result_record(checkpoint, engine, headline, timings, settings)
    if backend != "neuron":
        show("measuring this machine's memory bandwidth and matmul throughput for the floors")
    result["roofline"] = bench_roofline(result, checkpoint.spec, quantize=engine.settings.quantize)
    if lengths:
        result["at_length"] = bench_at_length(engine, checkpoint.spec, result, lengths, show)
    show(f"done: TTFT[{headline}] p50 {result['latency_summary']['ttft_ms']['p50']:.2f} ms, TPOT p50 "
         f"{result['latency_summary']['tpot_ms']['p50']:.2f} ms")
    return result


def _collect(timed: list[dict], buckets) -> dict:
    """Per-run records -> sample lists (one per run, or per run and step)."""
    return {"prefill": {b: [r["prefill_ms"][b] for r in timed] for b in buckets},
            "ttft": {b: [r["ttft_ms"][b] for r in timed] for b in buckets},
            "prefill_graph": {b: [r["prefill_graph_ms"][b] for r in timed] for b in buckets},
            "steps": [r["steps"] for r in timed], "step_graph": [r["step_graph_ms"] for r in timed],
            "e2e": [r["e2e_ms"] for r in timed], "outputs": outputs.record([r["outputs"] for r in timed])}


def _result_record(checkpoint, engine, headline: int, timings: dict, settings: dict) -> dict:
    decode_steps, run = timings["steps"], engine.settings
    result = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "git_commit": machine.git_commit(),
        "machine": machine.machine_info(),
        "versions": machine.package_versions(),
        "compiler_args": list(engine.backend.compiler_args),
        "spec_hash": checkpoint.spec.spec_hash(),
        "checkpoint": str(checkpoint.path),
        "backend": run.backend,
        "tp": run.tp,
        "dtype": run.short_dtype,
        "settings": settings,
        "prefill_bucket": headline,
        "metrics": {"prefill_ms": timings["prefill"][headline],
                    "decode_ms_per_token": [statistics.fmean(s) for s in decode_steps]},
        "prefill_ms_by_bucket": {str(b): v for b, v in timings["prefill"].items()},
        "decode_steps_ms": decode_steps,
        # the part of each call spent inside the backend's graph call (the rest is host-side work)
        "graph_ms": {"prefill_by_bucket": {str(b): v for b, v in timings["prefill_graph"].items()},
                     "decode_steps": timings["step_graph"]},
        "outputs": timings["outputs"],
        "latency": {"ttft_ms_by_bucket": {str(b): v for b, v in timings["ttft"].items()},
                    "e2e_ms": timings["e2e"], "generated_tokens": settings["new_tokens"] + 1},
    }
    result["summary"] = {name: summarize(v) for name, v in metric_samples(result).items()}
    result["summary"]["tokens_per_second"] = 1e3 / result["summary"]["decode_ms_per_token"]["mean"]
    result["latency_summary"] = latency_summary(result)
    return result


def latency_summary(result: dict) -> dict:
    """p50/p90/p99 of TTFT, TPOT and E2E, and the throughputs they imply."""
    out = {name: summarize(v) for name, v in latency_samples(result).items()}
    tokens = result["latency"]["generated_tokens"]
    out["throughput"] = {
        "decode_tokens_per_s": 1e3 / out["tpot_ms"]["mean"],
        "e2e_tokens_per_s": tokens * 1e3 / out["e2e_ms"]["mean"],
        "prefill_tokens_per_s": result["prefill_bucket"] * 1e3 / out["ttft_ms"]["p50"],
    }
    return out


def graph_medians(result: dict) -> dict[str, float]:
    """Median ms of each graph's whole call as the engine makes it: each bucket's prefill, one
    decode step."""
    medians = {f"prefill[{b}]": statistics.median(v) for b, v in result["prefill_ms_by_bucket"].items()}
    steps = [ms for run in result["decode_steps_ms"] for ms in run]
    medians["decode"] = statistics.median(steps)
    return medians


def graph_split(result: dict) -> tuple[dict[str, float], dict[str, float]] | None:
    """(median ms inside the backend's graph call, median ms of the host-side rest) per graph, or
    None for a result written before the split was recorded."""
    graph = result.get("graph_ms")
    if not graph:
        return None
    calls = {f"prefill[{b}]": v for b, v in result["prefill_ms_by_bucket"].items()}
    calls["decode"] = [ms for run in result["decode_steps_ms"] for ms in run]
    inside = {f"prefill[{b}]": v for b, v in graph["prefill_by_bucket"].items()}
    inside["decode"] = [ms for run in graph["decode_steps"] for ms in run]
    device = {g: statistics.median(inside[g]) for g in calls}
    host = {g: statistics.median([c - d for c, d in zip(calls[g], inside[g])]) for g in calls}
    return device, host


def bench_at_length(engine, spec, result: dict, lengths, show) -> dict:
    """TTFT and TPOT at each prompt length, as many runs as the bench's, with their floors."""
    settings = result["settings"]
    prompts = {n: bench_prompt(spec.vocab_size, n) for n in lengths}
    block = length.measure_at_length(engine, prompts, runs=settings["runs"], warmup=settings["warmup"],
                                     new_tokens=settings["new_tokens"], show=show)
    rates, _ = bench_rates(result["backend"], result["tp"], result["dtype"])
    return length.add_floors(block, spec, result, rates, sliding_cache=engine.settings.sliding_cache)


@functools.lru_cache(maxsize=None)
def _measured_once(dtype: str) -> tuple[dict, dict]:
    """This host's bandwidth and matmul rate, measured once per process (every bench in it shares
    them; the samples' spread is recorded beside them)."""
    return machine.measure_memory_bandwidth(), machine.measure_matmul_flops(dtype)


def _spread(measurement: dict, work: float) -> dict:
    rates = sorted(work / s for s in measurement["seconds"])
    return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1], "n": len(rates)}


def bench_rates(backend: str, tp: int, dtype: str):
    """(rates, their measured spread or None): published figures for the Neuron backend; measured
    ones (once per process) for anything that runs on this host."""
    if backend == "neuron":
        # an instance type without known rates is refused (GEMMA_PARITY_INSTANCE_RATES gives them)
        return neuron_instance_rates(machine.instance_type(), tp, dtype), None
    bandwidth, matmul = _measured_once(dtype)
    spread = {"memory_bytes_per_s": _spread(bandwidth, bandwidth["bytes_per_s"] * statistics.median(
                  bandwidth["seconds"])),
              "flops_per_s": _spread(matmul, matmul["flops_per_s"] * statistics.median(matmul["seconds"]))}
    return measured_rates(bandwidth, matmul), spread


def bench_roofline(result: dict, spec, quantize: str | None = None) -> dict:
    """Floors and efficiencies; efficiency is the floor over the graph call's median (the host-side
    part of each call is reported beside it, not counted); the weights int8 under `quantize`."""
    settings = result["settings"]
    rates, spread = bench_rates(result["backend"], result["tp"], result["dtype"])
    split = graph_split(result)
    block = roofline_block(spec, result["tp"], result["dtype"], settings["buckets"], settings["kv_len"], rates=rates,
                           measured_ms=split[0] if split else graph_medians(result), quantize=quantize)
    if split:
        for row in block["graphs"]:
            row["host_side_ms"] = split[1].get(row["graph"])
    if spread:
        block["rates_spread"] = spread
    return block
