"""The benchmark runner: timed prefill per bucket and greedy decode steps, with the latency
vocabulary (TTFT, TPOT, end-to-end, throughput) and the roofline floors of every graph.

  TTFT    one prefill of the bucket as a user waits for it: host embedding, the device graph, the
          logits back on the host, and the first token (argmax of the last position's logits).
  TPOT    one decode step: embed the fed-back token, the decode graph, argmax.
  E2E     the headline bucket's prompt to its last token: TTFT plus new_tokens decode steps
          (new_tokens + 1 tokens generated).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from datetime import datetime, timezone

from harness.errors import HarnessInputError
from harness.perf import machine
from harness.perf.results import FORMAT, dtype_name, latency_samples, metric_samples
from harness.perf.roofline import DEFAULT_INSTANCE, INSTANCE_CHIPS, instance_rates, measured_rates, roofline_block
from harness.perf.stats import summarize
from harness.progress import status

DEFAULT_RUNS, DEFAULT_WARMUP, DEFAULT_NEW_TOKENS = 20, 3, 16
PUBLISHED_BUCKET = 64  # the bucket the published prefill figure was measured at


def bench_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt that fills a bucket (ids 0-2 are pad/eos/bos: avoided)."""
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def _bench_run(engine, prompts: dict[int, list[int]], headline: int, new_tokens: int):
    """One run: a prefill per bucket (the headline bucket last), then decode steps continuing the
    headline prompt. Greedy tokens are fed back, as in real decoding."""
    prefill_ms, ttft_ms, steps = {}, {}, []
    gc.collect()
    gc.disable()  # a collection pause inside a timed step is noise, not the port's speed
    try:
        for bucket in sorted(prompts, key=lambda b: b == headline):
            start = time.perf_counter()
            result = engine.prefill(prompts[bucket])
            prefill_ms[bucket] = _ms_since(start)
            token = int(result.logits[-1].argmax())
            ttft_ms[bucket] = _ms_since(start)
        for step in range(new_tokens):
            step_start = time.perf_counter()
            token = int(engine.decode_step(token, headline + step).argmax())
            steps.append(_ms_since(step_start))
        e2e_ms = _ms_since(start)  # `start` is the headline prefill's
    finally:
        gc.enable()
    return prefill_ms, ttft_ms, steps, e2e_ms


def _check_bench_options(runs, warmup, buckets, new_tokens, kv_len) -> None:
    if runs < 1 or warmup < 0 or new_tokens < 1:
        raise HarnessInputError(f"--runs {runs}, --warmup {warmup}, --new-tokens {new_tokens}: need "
                                "runs >= 1, warmup >= 0 and new tokens >= 1")
    if not buckets or min(buckets) < 1:
        raise HarnessInputError(f"--buckets {buckets}: give positive bucket sizes, e.g. 16,64")
    if max(buckets) + new_tokens > kv_len:
        raise HarnessInputError(f"bucket {max(buckets)} + {new_tokens} new tokens exceed the KV length "
                                f"{kv_len}; use fewer --new-tokens or a smaller bucket")


def perf_engine(checkpoint, backend: str, tp: int, dtype, buckets, kv_len: int, **backend_kwargs):
    """The perf build `bench` times and serving runs: no capture outputs (on a compiled backend its
    prefill graphs return only the last real row). `check` judges this same build
    (harness/served.py), so what is timed is what is judged."""
    from harness.backends import build_engine

    if backend == "neuron":
        # Stale cache slots are never read (causal mask): keep the 44 MB/rank zeroing of the KV
        # cache out of the timed prefill, as a serving loop would.
        backend_kwargs.setdefault("zero_on_reset", False)
    return build_engine(checkpoint, backend=backend, tp=tp, dtype=dtype, buckets=buckets, kv_len=kv_len,
                        **backend_kwargs)


def run_bench(checkpoint, backend: str = "cpu", runs: int = DEFAULT_RUNS, warmup: int = DEFAULT_WARMUP,
              buckets=(PUBLISHED_BUCKET,), new_tokens: int = DEFAULT_NEW_TOKENS, tp: int = 2,
              dtype="bf16", kv_len: int | None = None, progress: bool = True, **backend_kwargs) -> dict:
    """Time `runs` prefills per bucket and `runs` x `new_tokens` decode steps after `warmup`
    discarded runs. Each decode_ms_per_token sample is one run's mean ms per token."""
    import torch

    from harness.engine import DEFAULT_KV_LEN

    kv_len = DEFAULT_KV_LEN if kv_len is None else kv_len
    buckets = tuple(sorted({int(b) for b in buckets}))
    _check_bench_options(runs, warmup, buckets, new_tokens, kv_len)
    dtype = dtype_name(dtype)
    show = status("bench", progress)
    show(f"building the {backend} engine (tp {tp}, {dtype}, buckets {list(buckets)})"
         + ("; a first compile takes many minutes" if backend == "neuron" else ""))
    engine = perf_engine(checkpoint, backend, tp=tp, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                         buckets=buckets, kv_len=kv_len, **backend_kwargs)
    headline = PUBLISHED_BUCKET if PUBLISHED_BUCKET in buckets else max(buckets)
    prompts = {b: bench_prompt(checkpoint.spec.vocab_size, b) for b in buckets}
    for k in range(warmup):
        show(f"warm-up {k + 1}/{warmup}")
        _bench_run(engine, prompts, headline, new_tokens)
    timings = {"prefill": {b: [] for b in buckets}, "ttft": {b: [] for b in buckets}, "steps": [], "e2e": []}
    for k in range(runs):
        prefill_ms, ttft_ms, steps, e2e_ms = _bench_run(engine, prompts, headline, new_tokens)
        for b in buckets:
            timings["prefill"][b].append(prefill_ms[b])
            timings["ttft"][b].append(ttft_ms[b])
        timings["steps"].append(steps)
        timings["e2e"].append(e2e_ms)
        show(f"run {k + 1}/{runs}: TTFT[{headline}] {ttft_ms[headline]:.1f} ms, "
             f"TPOT {statistics.fmean(steps):.1f} ms, E2E {e2e_ms:.1f} ms")
    settings = {"runs": runs, "warmup": warmup, "buckets": list(buckets), "new_tokens": new_tokens,
                "kv_len": kv_len}
    result = _result_record(checkpoint, engine, backend, tp, dtype, headline, timings, settings)
    if backend != "neuron":
        show("measuring this machine's memory bandwidth and matmul throughput for the floors")
    result["roofline"] = bench_roofline(result, checkpoint.spec)
    show(f"done: TTFT[{headline}] p50 {result['latency_summary']['ttft_ms']['p50']:.2f} ms, TPOT p50 "
         f"{result['latency_summary']['tpot_ms']['p50']:.2f} ms")
    return result


def _result_record(checkpoint, engine, backend, tp, dtype, headline, timings, settings) -> dict:
    decode_steps = timings["steps"]
    result = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "git_commit": machine.git_commit(),
        "machine": machine.machine_info(),
        "versions": machine.package_versions(),
        "compiler_args": list(getattr(engine.backend, "compiler_args", None) or []),
        "spec_hash": checkpoint.spec.spec_hash(),
        "checkpoint": str(checkpoint.path),
        "backend": backend,
        "tp": tp,
        "dtype": dtype,
        "settings": settings,
        "prefill_bucket": headline,
        "metrics": {"prefill_ms": timings["prefill"][headline],
                    "decode_ms_per_token": [statistics.fmean(s) for s in decode_steps]},
        "prefill_ms_by_bucket": {str(b): v for b, v in timings["prefill"].items()},
        "decode_steps_ms": decode_steps,
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
    """Measured median ms per device graph: each bucket's prefill call, one decode step."""
    medians = {f"prefill[{b}]": statistics.median(v) for b, v in result["prefill_ms_by_bucket"].items()}
    steps = [ms for run in result["decode_steps_ms"] for ms in run]
    medians["decode"] = statistics.median(steps)
    return medians


def bench_rates(backend: str, tp: int, dtype: str):
    """Published figures for the Neuron backend; measured ones for anything that runs on this host."""
    if backend == "neuron":
        instance = machine.instance_type()
        return instance_rates(instance if instance in INSTANCE_CHIPS else DEFAULT_INSTANCE, tp, dtype)
    return measured_rates(machine.measure_memory_bandwidth(), machine.measure_matmul_flops(dtype))


def bench_roofline(result: dict, spec) -> dict:
    settings = result["settings"]
    rates = bench_rates(result["backend"], result["tp"], result["dtype"])
    return roofline_block(spec, result["tp"], result["dtype"], settings["buckets"], settings["kv_len"], rates,
                    graph_medians(result))
