"""Write a synthetic perf history: what `perf compare --history` and its trend plot look like.

Runs of the real 12B's shape on inf2 (numbers invented, seeded): TTFT at bucket 64 near 95 ms and
TPOT near 40 ms, with a +12% TTFT step planted at run 15 of 24 (the 16th run onward), so the
change point, the commit of the first slow run and the budget line are all on the plot. Not a
measurement: docs/performance.md's plot is drawn from it with

    python benchmarks/synthetic_history.py --out /tmp/synthetic-history
    gemma-parity perf compare --history /tmp/synthetic-history --budget ttft_ms=101 --budget tpot_ms=56 \\
        --markdown /tmp/perf-trend.md --plot docs/perf-trend.png
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

from harness.perf import FORMAT, append_history, outputs
from harness.perf.bench import latency_summary

RUNS, STEP_AT, STEP = 24, 15, 1.12
SAMPLES, NEW_TOKENS = 20, 16


def lognormal(rng: random.Random, median: float, sigma: float, n: int) -> list[float]:
    return [round(median * math.exp(rng.gauss(0, sigma)), 3) for _ in range(n)]


def synthetic_run(i: int, rng: random.Random, start: datetime) -> dict:
    level = 1.0 + 0.01 * rng.gauss(0, 1)  # run-to-run drift of a real runner
    prefill = lognormal(rng, 94.0 * level * (STEP if i >= STEP_AT else 1.0), 0.015, SAMPLES)
    ttft = [ms + 0.4 for ms in prefill]  # the first token's argmax on the host
    steps = [lognormal(rng, 40.0 * level, 0.02, NEW_TOKENS) for _ in range(SAMPLES)]
    result = {
        "format": FORMAT, "created": (start + timedelta(hours=6 * i)).isoformat(timespec="microseconds"),
        "git_commit": hashlib.sha1(f"synthetic {i}".encode()).hexdigest(),
        "machine": {"cpu_model": "AMD EPYC 7R13 Processor (synthetic)", "cores": 32, "neuron_cores": 2,
                    "hostname": "inf2-runner", "instance_type": "inf2.8xlarge"},
        "versions": {"python": "3.11", "neuronx-cc": "2.26.6360"}, "compiler_args": [], "spec_hash": "synthetic-12b",
        "backend": "neuron", "tp": 2, "dtype": "bf16", "prefill_bucket": 64,
        "settings": {"runs": SAMPLES, "warmup": 3, "buckets": [64], "new_tokens": NEW_TOKENS, "kv_len": 256},
        "metrics": {"prefill_ms": prefill, "decode_ms_per_token": [sum(s) / len(s) for s in steps]},
        "prefill_ms_by_bucket": {"64": prefill}, "decode_steps_ms": steps,
        "latency": {"ttft_ms_by_bucket": {"64": ttft},
                    "e2e_ms": [t + sum(s) for t, s in zip(ttft, steps)], "generated_tokens": NEW_TOKENS + 1},
    }
    result["latency_summary"] = latency_summary(result)
    # the same (invented) tokens every run: the step is a slowdown, not a change of output
    prompt = {"bucket": 64, "tokens": [(7 * k) % 1000 + 3 for k in range(NEW_TOKENS + 1)],
              "margins": [1.5] * (NEW_TOKENS + 1)}
    result["outputs"] = {"prompts": [prompt], "fingerprint": outputs.fingerprint([prompt]), "runs_agree": True}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="history directory to create")
    parser.add_argument("--seed", type=int, default=14)
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"{args.out}: not empty; choose a new directory", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    for i in range(RUNS):
        append_history(synthetic_run(i, rng, start), args.out)
    print(f"wrote {RUNS} runs to {args.out} (TTFT step x{STEP} from run {STEP_AT + 1} on)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
