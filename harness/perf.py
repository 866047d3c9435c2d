"""Performance: timed prefill and decode runs, budgets, a run history, and regression detection.

Result files (format 1) keep the raw samples, not only summaries, so that two runs are compared
with a rank test rather than a bare ratio of means.

Regression rule. A metric regresses only when BOTH
  * its median got slower by more than `factor` (default 1.1, a 10% slowdown), and
  * a one-sided Mann-Whitney U test says the current samples tend to be larger than the
    baseline's (p < alpha, default 0.01; normal approximation with tie correction).
The ratio alone alarms on noisy runs; the test alone alarms on real but negligible 1% changes.
Budgets are absolute ceilings on the current median, checked separately from the baseline.

History. A directory with one JSON file per run, named <created, UTC>-<git commit>.json, written
atomically and never overwritten. The baseline of `perf compare --history DIR`:
  1. DIR/baseline.json if present: a pinned run (copy a run file there to pin it);
  2. otherwise, per metric, the "median run" of the last HISTORY_WINDOW runs before the newest
     that are comparable with it (same machine, spec, backend, tp, dtype and prefill bucket): the
     run whose median is the upper median of their medians. One unusually fast or slow run never
     becomes the baseline, and the samples tested are one real run's, so run-to-run drift is not
     mistaken for a within-run signal (pooling every run's samples would be);
  3. no comparable earlier run: no baseline, budgets only (the first run on a new machine passes).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from harness.atomic import write_json_atomic, write_text_atomic
from harness.errors import HarnessInputError
from harness.progress import status

FORMAT = 1
# Absolute ceilings on the median, in ms, for the real 12B on one inf2 chip at TP=2, bf16, bucket 64.
BUDGETS = {
    # The published port's first-token prefill: about 101 ms at the 64-token bucket (DESIGN §3, §9).
    "prefill_ms": 101.0,
    # No decode figure is published. The floor is one read of the ~23 GB of bf16 device weights at
    # 820 GB/s HBM, about 28 ms per step (DESIGN §9). Budget = 2x that floor: a memory-bound step
    # at 50% of peak bandwidth, leaving room for the KV read, the all-reduces between the two
    # cores and the host round trip per token.
    "decode_ms_per_token": 56.0,
}
DEFAULT_FACTOR = 1.1
DEFAULT_ALPHA = 0.01
DEFAULT_RUNS, DEFAULT_WARMUP, DEFAULT_NEW_TOKENS = 20, 3, 16
PUBLISHED_BUCKET = 64  # the bucket the published prefill figure was measured at
HISTORY_WINDOW = 5
BASELINE_FILE = "baseline.json"
DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}
VERSION_PACKAGES = ("torch", "transformers", "safetensors", "numpy", "gemma-parity",
                    "torch-neuronx", "neuronx-cc", "neuronx-distributed", "libneuronxla", "torch-xla")
# Names the Neuron backend may give its NeuronCore count function (it is written concurrently).
NEURON_COUNT_FUNCTIONS = ("neuron_core_count", "count_neuron_cores")
# Timings are only comparable when these agree (--allow-mismatch overrides).
COMPARABLE_FIELDS = ("machine.cpu_model", "machine.neuron_cores", "spec_hash", "backend", "tp",
                     "dtype", "prefill_bucket")


# ---- the machine and the software -------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def neuron_core_count() -> int:
    """NeuronCores on this host, asked of the Neuron backend only if it imports (0 elsewhere)."""
    try:
        from harness.backends import neuron
    except Exception:  # no Neuron SDK, or the PyPI placeholder packages the backend refuses
        return 0
    for name in NEURON_COUNT_FUNCTIONS:
        count = getattr(neuron, name, None)
        if callable(count):
            try:
                return int(count())
            except Exception:  # a host without the Neuron driver: no cores to count
                return 0
    return 0


def machine_info() -> dict:
    return {"cpu_model": cpu_model(), "cores": os.cpu_count() or 0,
            "neuron_cores": neuron_core_count(), "hostname": socket.gethostname()}


def package_versions() -> dict:
    found = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def git_commit() -> str:
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GITHUB_SHA", "unknown")  # an installed wheel has no .git beside it


# ---- statistics ---------------------------------------------------------------------------------

def percentile(samples, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(samples) -> dict:
    return {"n": len(samples), "p50": percentile(samples, 50), "p90": percentile(samples, 90),
            "p99": percentile(samples, 99), "mean": statistics.fmean(samples),
            "min": min(samples), "max": max(samples)}


def average_ranks(values) -> tuple[list[float], float]:
    """Ranks 1..n with ties given their average rank, and the tie term sum(t^3 - t)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    tie_term = 0.0
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2.0 + 1.0
        t = end - start + 1
        tie_term += t ** 3 - t
        start = end + 1
    return ranks, tie_term


def mann_whitney_greater(current, baseline) -> float:
    """One-sided p-value that `current` samples tend to be larger (slower) than `baseline`'s.

    Mann-Whitney U, normal approximation with tie correction and continuity correction: the same
    number as scipy.stats.mannwhitneyu(current, baseline, alternative="greater",
    method="asymptotic"), without needing scipy at run time.
    """
    n1, n2 = len(current), len(baseline)
    if n1 == 0 or n2 == 0:
        raise HarnessInputError("Mann-Whitney U needs at least one sample on each side")
    ranks, tie_term = average_ranks(list(current) + list(baseline))
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    variance = n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0:  # every sample equal: no evidence either way
        return 1.0
    z = (u - n1 * n2 / 2.0 - 0.5) / math.sqrt(variance)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def smallest_p(n1: int, n2: int) -> float:
    """The p-value when every current sample is slower than every baseline sample: with fewer
    runs than this allows, no slowdown can ever be significant at alpha."""
    n = n1 + n2
    z = (n1 * n2 / 2.0 - 0.5) / math.sqrt(n1 * n2 * (n + 1) / 12.0)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


# ---- result files -------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_NAMES:
        raise HarnessInputError(f"unknown dtype {dtype!r}; use bf16 or fp32")
    return DTYPE_NAMES[name]


def metric_samples(result: dict) -> dict[str, list[float]]:
    """Every compared metric: prefill at the headline bucket, at other buckets, decode per token."""
    samples = {"prefill_ms": result["metrics"]["prefill_ms"]}
    for bucket, values in sorted(result.get("prefill_ms_by_bucket", {}).items(), key=lambda kv: int(kv[0])):
        if int(bucket) != int(result["prefill_bucket"]):
            samples[f"prefill_ms[{bucket}]"] = values
    samples["decode_ms_per_token"] = result["metrics"]["decode_ms_per_token"]
    return samples


def validate_result(result, source: str) -> dict:
    """A loaded result must be format 1 with non-empty numeric samples; say what is wrong."""
    if not isinstance(result, dict) or result.get("format") != FORMAT:
        got = result.get("format") if isinstance(result, dict) else type(result).__name__
        raise HarnessInputError(f"{source}: not a perf result of format {FORMAT} (format {got!r}); "
                                "pass a file written by `gemma-parity bench`")
    for key in ("machine", "spec_hash", "backend", "tp", "dtype", "created", "prefill_bucket", "metrics"):
        if key not in result:
            raise HarnessInputError(f"{source}: key {key!r} is missing; the file is incomplete or was "
                                    "not written by `gemma-parity bench`")
    if not isinstance(result["metrics"], dict) or not isinstance(result.get("prefill_ms_by_bucket", {}), dict):
        raise HarnessInputError(f"{source}: metrics and prefill_ms_by_bucket must be objects of sample "
                                "lists; the file was not written by `gemma-parity bench`")
    lists = {f"metrics.{name}": result["metrics"].get(name) for name in ("prefill_ms", "decode_ms_per_token")}
    lists.update({f"prefill_ms_by_bucket.{b}": v for b, v in result.get("prefill_ms_by_bucket", {}).items()})
    for name, values in lists.items():
        if not isinstance(values, list) or not values or not all(
                isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise HarnessInputError(f"{source}: {name} must be a non-empty list of finite numbers; "
                                    "re-run the benchmark")
    return result


def load_result(path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise HarnessInputError(f"{path}: cannot read the perf result ({exc.strerror}); check the "
                                "path") from None
    try:
        result = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HarnessInputError(f"{path}: not valid JSON ({exc}); delete it or re-run the "
                                "benchmark") from None
    return validate_result(result, str(path))


def write_text(path, text: str, overwrite: bool = False) -> Path:
    """Atomic, and without `overwrite` never over an existing file (see harness.atomic)."""
    return write_text_atomic(path, text, no_clobber=not overwrite)


def write_json(path, obj, overwrite: bool = False) -> Path:
    return write_json_atomic(path, obj, no_clobber=not overwrite, indent=1, sort_keys=True)


# ---- the benchmark ------------------------------------------------------------------------------

def bench_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt that fills a bucket (ids 0-2 are pad/eos/bos: avoided)."""
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def _timed_ms(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - start) * 1e3


def _bench_run(engine, prompts: dict[int, list[int]], headline: int, new_tokens: int):
    """One run: a prefill per bucket (the headline bucket last), then decode steps continuing the
    headline prompt. Greedy tokens are fed back, as in real decoding."""
    prefill_ms = {}
    gc.collect()
    gc.disable()  # a collection pause inside a timed step is noise, not the port's speed
    try:
        for bucket in sorted(prompts, key=lambda b: b == headline):
            result, prefill_ms[bucket] = _timed_ms(engine.prefill, prompts[bucket])
        token = int(result.logits[-1].argmax())
        steps = []
        for step in range(new_tokens):
            logits, ms = _timed_ms(engine.decode_step, token, headline + step)
            steps.append(ms)
            token = int(logits.argmax())
    finally:
        gc.enable()
    return prefill_ms, steps


def _check_bench_options(runs, warmup, buckets, new_tokens, kv_len) -> None:
    if runs < 1 or warmup < 0 or new_tokens < 1:
        raise HarnessInputError(f"--runs {runs}, --warmup {warmup}, --new-tokens {new_tokens}: need "
                                "runs >= 1, warmup >= 0 and new tokens >= 1")
    if not buckets or min(buckets) < 1:
        raise HarnessInputError(f"--buckets {buckets}: give positive bucket sizes, e.g. 16,64")
    if max(buckets) + new_tokens > kv_len:
        raise HarnessInputError(f"bucket {max(buckets)} + {new_tokens} new tokens exceed the KV length "
                                f"{kv_len}; use fewer --new-tokens or a smaller bucket")


def run_bench(checkpoint, backend: str = "cpu", runs: int = DEFAULT_RUNS, warmup: int = DEFAULT_WARMUP,
              buckets=(PUBLISHED_BUCKET,), new_tokens: int = DEFAULT_NEW_TOKENS, tp: int = 2,
              dtype="bf16", kv_len: int | None = None, progress: bool = True, **backend_kwargs) -> dict:
    """Time `runs` prefills per bucket and `runs` x `new_tokens` decode steps after `warmup`
    discarded runs. Each decode sample is one run's mean ms per token."""
    import torch

    from harness.backends import build_engine
    from harness.engine import DEFAULT_KV_LEN

    kv_len = DEFAULT_KV_LEN if kv_len is None else kv_len
    buckets = tuple(sorted({int(b) for b in buckets}))
    _check_bench_options(runs, warmup, buckets, new_tokens, kv_len)
    dtype = dtype_name(dtype)
    show = status("bench", progress)
    show(f"building the {backend} engine (tp {tp}, {dtype}, buckets {list(buckets)})"
         + ("; a first compile takes many minutes" if backend == "neuron" else ""))
    if backend == "neuron":
        # Stale cache slots are never read (causal mask): keep the 44 MB/rank zeroing of the KV
        # cache out of the timed prefill, as a serving loop would.
        backend_kwargs.setdefault("zero_on_reset", False)
    engine = build_engine(checkpoint, backend=backend, tp=tp,
                          dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                          buckets=buckets, kv_len=kv_len, **backend_kwargs)
    headline = PUBLISHED_BUCKET if PUBLISHED_BUCKET in buckets else max(buckets)
    prompts = {b: bench_prompt(checkpoint.spec.vocab_size, b) for b in buckets}
    for k in range(warmup):
        show(f"warm-up {k + 1}/{warmup}")
        _bench_run(engine, prompts, headline, new_tokens)
    by_bucket = {b: [] for b in buckets}
    decode_steps = []
    for k in range(runs):
        prefill_ms, steps = _bench_run(engine, prompts, headline, new_tokens)
        for b, ms in prefill_ms.items():
            by_bucket[b].append(ms)
        decode_steps.append(steps)
        show(f"run {k + 1}/{runs}: prefill[{headline}] {prefill_ms[headline]:.1f} ms, "
             f"decode {statistics.fmean(steps):.1f} ms/token")
    result = _result_record(checkpoint, engine, backend, tp, dtype, headline, by_bucket, decode_steps,
                            settings={"runs": runs, "warmup": warmup, "buckets": list(buckets),
                                      "new_tokens": new_tokens, "kv_len": kv_len})
    show(f"done: prefill[{headline}] p50 {result['summary']['prefill_ms']['p50']:.2f} ms, decode p50 "
         f"{result['summary']['decode_ms_per_token']['p50']:.2f} ms/token")
    return result


def _result_record(checkpoint, engine, backend, tp, dtype, headline, by_bucket, decode_steps,
                   settings) -> dict:
    result = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "versions": package_versions(),
        "compiler_args": list(getattr(engine.backend, "compiler_args", None) or []),
        "spec_hash": checkpoint.spec.spec_hash(),
        "checkpoint": str(checkpoint.path),
        "backend": backend,
        "tp": tp,
        "dtype": dtype,
        "settings": settings,
        "prefill_bucket": headline,
        "metrics": {"prefill_ms": by_bucket[headline],
                    "decode_ms_per_token": [statistics.fmean(s) for s in decode_steps]},
        "prefill_ms_by_bucket": {str(b): v for b, v in by_bucket.items()},
        "decode_steps_ms": decode_steps,
    }
    result["summary"] = {name: summarize(v) for name, v in metric_samples(result).items()}
    result["summary"]["tokens_per_second"] = 1e3 / result["summary"]["decode_ms_per_token"]["mean"]
    return result


# ---- comparison ---------------------------------------------------------------------------------

@dataclass
class MetricComparison:
    metric: str
    baseline_median: float | None
    current_median: float | None
    ratio: float | None
    p_value: float | None
    regressed: bool
    verdict: str


@dataclass
class BudgetCheck:
    metric: str
    budget_ms: float
    current_median: float
    ok: bool


@dataclass
class Comparison:
    baseline_label: str
    current_label: str
    factor: float
    alpha: float
    metrics: list[MetricComparison] = field(default_factory=list)
    budgets: list[BudgetCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[str]:
        return [m.metric for m in self.metrics if m.regressed]

    @property
    def broken_budgets(self) -> list[str]:
        return [b.metric for b in self.budgets if not b.ok]

    @property
    def failed(self) -> bool:
        return bool(self.regressions or self.broken_budgets)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(failed=self.failed, regressions=self.regressions, broken_budgets=self.broken_budgets)
        return d


def _field(result: dict, dotted: str):
    value = result
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def mismatches(baseline: dict, current: dict) -> list[tuple[str, object, object]]:
    return [(f, _field(baseline, f), _field(current, f)) for f in COMPARABLE_FIELDS
            if _field(baseline, f) != _field(current, f)]


def check_comparable(baseline: dict, current: dict, allow_mismatch: bool = False,
                     baseline_label: str = "baseline", current_label: str = "current") -> list[str]:
    """Refuse runs that are not comparable; with allow_mismatch, return the differences as notes."""
    diffs = [f"{name} differs ({baseline_label}: {a!r}, {current_label}: {b!r})"
             for name, a, b in mismatches(baseline, current)]
    if diffs and not allow_mismatch:
        raise HarnessInputError(
            f"cannot compare these runs: {'; '.join(diffs)}. Timings from different machines, models "
            "or settings are not comparable; compare runs made alike, or pass --allow-mismatch "
            "(allow_mismatch=True) to compare anyway."
        )
    return [f"mismatch allowed: {d}" for d in diffs]


def software_notes(baseline: dict, current: dict) -> list[str]:
    """What changed in the software between the runs: usually why the numbers moved."""
    notes = []
    old, new = baseline.get("versions", {}), current.get("versions", {})
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            notes.append(f"version of {name}: {old.get(name, 'absent')} -> {new.get(name, 'absent')}")
    if baseline.get("compiler_args") != current.get("compiler_args"):
        notes.append(f"compiler args: {baseline.get('compiler_args')} -> {current.get('compiler_args')}")
    return notes


def compare_metric(metric: str, baseline, current, factor: float, alpha: float) -> MetricComparison:
    if not baseline or not current:
        side = "baseline" if not current else "current"
        return MetricComparison(metric, _median(baseline), _median(current), None, None, False,
                                f"only in {side}")
    base, cur = statistics.median(baseline), statistics.median(current)
    ratio = cur / base if base > 0 else math.inf
    p = mann_whitney_greater(current, baseline)
    regressed = ratio > factor and p < alpha
    if regressed:
        verdict = "REGRESSION"
    elif smallest_p(len(current), len(baseline)) >= alpha:
        verdict = f"too few runs to test at alpha {alpha:g}"
    elif ratio > factor:
        verdict = "slower, not significant"
    elif p < alpha and ratio > 1:
        verdict = f"slower, within factor {factor:g}"
    elif ratio < 1 / factor:
        verdict = "faster"
    else:
        verdict = "ok"
    return MetricComparison(metric, base, cur, ratio, p, regressed, verdict)


def _median(samples):
    return statistics.median(samples) if samples else None


def parse_budgets(items) -> dict[str, float]:
    """["prefill_ms=101", ...] -> {"prefill_ms": 101.0}."""
    budgets = {}
    for item in items or ():
        name, _, value = str(item).partition("=")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if not name.strip() or not limit > 0 or math.isinf(limit):
            raise HarnessInputError(f"--budget {item!r}: expected METRIC=MS with a positive number, "
                                    "e.g. prefill_ms=101")
        budgets[name.strip()] = limit
    return budgets


def check_budgets(current_samples: dict[str, list[float]], budgets: dict[str, float]) -> list[BudgetCheck]:
    checks = []
    for metric, limit in budgets.items():
        if metric not in current_samples:
            raise HarnessInputError(f"--budget {metric}: no such metric in the current run; use one "
                                    f"of {', '.join(current_samples)}")
        median = statistics.median(current_samples[metric])
        checks.append(BudgetCheck(metric, limit, median, median <= limit))
    return checks


def compare_samples(baseline_samples, current_samples, factor: float = DEFAULT_FACTOR,
                    alpha: float = DEFAULT_ALPHA, budgets=None, baseline_label: str = "baseline",
                    current_label: str = "current") -> Comparison:
    """Compare metric -> samples mappings; `baseline_samples` None means budgets only."""
    if factor < 1 or not 0 < alpha < 1:
        raise HarnessInputError(f"--factor {factor} / alpha {alpha}: need factor >= 1 and 0 < alpha < 1")
    comp = Comparison(baseline_label, current_label, factor, alpha)
    if baseline_samples is not None:
        names = list(current_samples) + [m for m in baseline_samples if m not in current_samples]
        comp.metrics = [compare_metric(m, baseline_samples.get(m), current_samples.get(m), factor, alpha)
                        for m in names]
    comp.budgets = check_budgets(current_samples, budgets or {})
    return comp


def compare_results(baseline: dict | None, current: dict, factor: float = DEFAULT_FACTOR,
                    alpha: float = DEFAULT_ALPHA, budgets=None, allow_mismatch: bool = False,
                    baseline_label: str = "baseline", current_label: str = "current") -> Comparison:
    """Compare two bench results (machine, spec and settings must match unless allow_mismatch)."""
    notes = []
    if baseline is not None:
        notes = check_comparable(baseline, current, allow_mismatch, baseline_label, current_label)
        notes += software_notes(baseline, current)
    comp = compare_samples(None if baseline is None else metric_samples(baseline),
                           metric_samples(current), factor, alpha, budgets, baseline_label, current_label)
    comp.notes = notes + comp.notes
    return comp


def compare_files(baseline_path, current_path, **kwargs) -> Comparison:
    return compare_results(load_result(baseline_path), load_result(current_path),
                           baseline_label=str(baseline_path), current_label=str(current_path), **kwargs)


# ---- history ------------------------------------------------------------------------------------

def history_name(result: dict) -> str:
    created = datetime.fromisoformat(result["created"]).astimezone(timezone.utc)
    return f"{created:%Y%m%dT%H%M%S%fZ}-{str(result.get('git_commit', 'unknown'))[:12]}.json"


def append_history(result: dict, directory) -> Path:
    """Add a run to the history: a new file, atomically, never replacing one already there."""
    directory = Path(directory)
    stem = history_name(result)[:-len(".json")]
    for k in range(100):
        path = directory / (f"{stem}.json" if k == 0 else f"{stem}-{k}.json")
        if path.exists():
            continue
        try:
            return write_json(path, result, overwrite=False)
        except HarnessInputError:
            continue  # another writer took this name between the check and the link
    raise HarnessInputError(f"{directory}: 100 run files already named {stem}*; clean the history")


def load_history(directory) -> list[tuple[Path, dict]]:
    """Every run in the directory (baseline.json aside), oldest first by creation time."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HarnessInputError(f"{directory}: history directory not found; create it with "
                                f"`gemma-parity bench ... --history {directory}`")
    runs = [(p, load_result(p)) for p in sorted(directory.glob("*.json")) if p.name != BASELINE_FILE]
    if not runs:
        raise HarnessInputError(f"{directory}: no run files (*.json); add one with "
                                f"`gemma-parity bench ... --history {directory}`")
    return sorted(runs, key=lambda run: (datetime.fromisoformat(run[1]["created"]), run[0].name))


def median_run_samples(runs: list[tuple[Path, dict]]) -> tuple[dict[str, list[float]], list[str]]:
    """Per metric, the samples of the run whose median is the upper median of the runs' medians
    (upper: when two runs tie for the middle, the slower one, which errs against false alarms)."""
    samples, notes = {}, []
    names = dict.fromkeys(m for _, r in reversed(runs) for m in metric_samples(r))  # newest's order
    for metric in names:
        having = [(statistics.median(metric_samples(r)[metric]), p.name, metric_samples(r)[metric])
                  for p, r in runs if metric in metric_samples(r)]
        having.sort(key=lambda h: h[0])
        median, name, chosen = having[len(having) // 2]
        samples[metric] = chosen
        notes.append(f"baseline {metric}: {name} (median run of {len(having)})")
    return samples, notes


def compare_history(directory, factor: float = DEFAULT_FACTOR, alpha: float = DEFAULT_ALPHA,
                    budgets=None, allow_mismatch: bool = False) -> Comparison:
    """The newest run against the history's baseline (see the module docstring)."""
    directory = Path(directory)
    runs = load_history(directory)
    newest_path, newest = runs[-1]
    pinned = directory / BASELINE_FILE
    if pinned.is_file():
        return compare_results(load_result(pinned), newest, factor, alpha, budgets, allow_mismatch,
                               baseline_label=str(pinned), current_label=str(newest_path))
    earlier = [(p, r) for p, r in runs[:-1] if allow_mismatch or not mismatches(r, newest)]
    earlier = earlier[-HISTORY_WINDOW:]
    if not earlier:
        comp = compare_samples(None, metric_samples(newest), factor, alpha, budgets,
                               "none", str(newest_path))
        comp.notes.append(f"no earlier run in {directory} comparable with the newest (same "
                          f"{', '.join(COMPARABLE_FIELDS)}): budgets checked only")
        return comp
    samples, notes = median_run_samples(earlier)
    comp = compare_samples(samples, metric_samples(newest), factor, alpha, budgets,
                           f"median run of the last {len(earlier)} comparable runs in {directory}",
                           str(newest_path))
    newest_earlier = earlier[-1][1]
    comp.notes = (check_comparable(newest_earlier, newest, True) + software_notes(newest_earlier, newest)
                  + notes)
    return comp


# ---- rendering ----------------------------------------------------------------------------------

def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def comparison_tables(comp: Comparison) -> tuple[list[str], list[list[str]]]:
    header = ["metric", "baseline p50 ms", "current p50 ms", "ratio", "p-value", "verdict"]
    rows = [[m.metric, _ms(m.baseline_median), _ms(m.current_median),
             "-" if m.ratio is None else f"{m.ratio:.3f}",
             "-" if m.p_value is None else f"{m.p_value:.2g}", m.verdict] for m in comp.metrics]
    rows += [[f"budget {b.metric}", f"<= {b.budget_ms:g}", _ms(b.current_median),
              f"{b.current_median / b.budget_ms:.3f}", "-", "ok" if b.ok else "OVER BUDGET"]
             for b in comp.budgets]
    return header, rows


def status_line(comp: Comparison) -> str:
    if not comp.failed:
        return "perf: ok"
    parts = [f"regression in {', '.join(comp.regressions)}"] if comp.regressions else []
    parts += [f"over budget: {', '.join(comp.broken_budgets)}"] if comp.broken_budgets else []
    return "perf: FAILED (" + "; ".join(parts) + ")"


def render_text(comp: Comparison) -> str:
    header, rows = comparison_tables(comp)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [status_line(comp), f"baseline: {comp.baseline_label}", f"current:  {comp.current_label}",
           f"rule: regression = median ratio > {comp.factor:g} and one-sided Mann-Whitney p < {comp.alpha:g}",
           "", line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out += [f"note: {n}" for n in comp.notes]
    return "\n".join(out) + "\n"


def render_markdown(comp: Comparison) -> str:
    header, rows = comparison_tables(comp)
    icon = "❌" if comp.failed else "✅"
    out = [f"### {icon} {status_line(comp)}", "",
           f"Baseline: `{comp.baseline_label}`  ", f"Current: `{comp.current_label}`  ",
           f"A metric regresses when its median ratio exceeds {comp.factor:g} **and** a one-sided "
           f"Mann-Whitney U test gives p < {comp.alpha:g}.", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    if comp.notes:
        out += [""] + [f"- {n}" for n in comp.notes]
    return "\n".join(out) + "\n"


def render_bench_summary(result: dict) -> str:
    lines = [f"{result['backend']} tp={result['tp']} {result['dtype']} spec {result['spec_hash']} "
             f"commit {str(result['git_commit'])[:12]}"]
    for name, s in result["summary"].items():
        if isinstance(s, dict):
            lines.append(f"  {name:<22} p50 {s['p50']:9.2f}  p90 {s['p90']:9.2f}  p99 {s['p99']:9.2f}  "
                         f"mean {s['mean']:9.2f} ms  (n={s['n']})")
    lines.append(f"  tokens_per_second      {result['summary']['tokens_per_second']:.1f}")
    return "\n".join(lines) + "\n"
