"""Result files (format 1) and the run history: their metrics, validation, atomic writes.

A result keeps the raw samples, not only summaries, so that two runs are compared with a rank test
rather than a bare ratio of means. The history is a directory with one JSON file per run, named
<created, UTC>-<git commit>.json, written atomically and never overwritten; DIR/baseline.json, if
present, is a pinned baseline.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path

from harness.base.atomic import write_json_atomic, write_text_atomic
from harness.base.errors import HarnessInputError, read_json_file
from harness.base.settings import short_dtype_name

FORMAT = 1
BASELINE_FILE = "baseline.json"
# Timings are only comparable when these agree (--allow-mismatch overrides).
COMPARABLE_FIELDS = ("machine.cpu_model", "machine.neuron_cores", "spec_hash", "backend", "tp",
                     "dtype", "prefill_bucket", "quantize")
# Fields that make another configuration, never comparable even with --allow-mismatch: an int8 build
# is not a regression (or a speedup) of the unquantized one (docs/quantization.md).
CONFIGURATION_FIELDS = ("quantize",)
REQUIRED_KEYS = ("machine", "spec_hash", "backend", "tp", "dtype", "created", "prefill_bucket", "metrics")


def dtype_name(dtype) -> str:
    """"bf16" or "fp32", the name a bench result records, from any name of the vocabulary."""
    return short_dtype_name(dtype)


def metric_samples(result: dict) -> dict[str, list[float]]:
    """Every compared metric: prefill at the headline bucket, at other buckets, decode per token."""
    samples = {"prefill_ms": result["metrics"]["prefill_ms"]}
    for bucket, values in sorted(result.get("prefill_ms_by_bucket", {}).items(), key=lambda kv: int(kv[0])):
        if int(bucket) != int(result["prefill_bucket"]):
            samples[f"prefill_ms[{bucket}]"] = values
    samples["decode_ms_per_token"] = result["metrics"]["decode_ms_per_token"]
    samples.update(length_samples(result))
    samples.update(batch_samples(result))
    samples.update(speculative_samples(result))
    return samples


def batch_samples(result: dict) -> dict[str, list[float]]:
    """`prefill_ms@b{B}` (every prompt's prefill) and `step_ms@b{B}` (one decode step of all B rows)
    per batch size of `bench --batch`; empty for a result benched without batches."""
    samples = {}
    for row in (result.get("batch") or {}).get("rows", []):
        samples[f"prefill_ms@b{row['batch']}"] = row["prefill_samples_ms"]
        if row.get("step_samples_ms"):
            samples[f"step_ms@b{row['batch']}"] = row["step_samples_ms"]
    return samples


def batch_lists(result: dict) -> dict[str, object]:
    """The sample lists of the batch block by their place in the file (for validation)."""
    block = result.get("batch")
    if block is None:
        return {}
    rows = block.get("rows") if isinstance(block, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("batch"), int) for r in rows):
        return {"batch.rows": None}
    lists = {f"batch.rows[{r['batch']}].prefill_samples_ms": r.get("prefill_samples_ms") for r in rows}
    lists.update({f"batch.rows[{r['batch']}].step_samples_ms": r["step_samples_ms"] for r in rows
                  if r.get("step_samples_ms", []) != []})  # none: bench --new-tokens 1 (no step)
    return lists


def speculative_samples(result: dict) -> dict[str, list[float]]:
    """`speculative_ms_per_token[k=K]`, one sample per run, for a result benched with --speculate K
    (harness/perf/speculative.py); empty otherwise. Accepted drafts per verify is reported, not
    compared (it is not a time)."""
    block = result.get("speculative")
    if not isinstance(block, dict) or not isinstance(block.get("samples"), list):
        return {}
    return {f"speculative_ms_per_token[k={block.get('k')}]": [s["speculative_ms_per_token"] for s in block["samples"]]}


def length_samples(result: dict) -> dict[str, list[float]]:
    """`ttft_ms@L` and `tpot_ms@L` per length; empty for a result benched without lengths."""
    samples = {}
    for row in (result.get("at_length") or {}).get("lengths", []):
        samples[f"ttft_ms@{row['length']}"] = row["ttft_ms"]
        samples[f"tpot_ms@{row['length']}"] = row["tpot_ms"]
    return samples


def length_lists(result: dict) -> dict[str, object]:
    """The sample lists of the at_length block by their place in the file (for validation)."""
    block = result.get("at_length")
    if block is None:
        return {}
    rows = block.get("lengths") if isinstance(block, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("length"), int) for r in rows):
        return {"at_length.lengths": None}
    return {f"at_length.lengths[{r['length']}].{key}": r.get(key) for r in rows for key in ("ttft_ms", "tpot_ms")}


def latency_samples(result: dict) -> dict[str, list[float]]:
    """TTFT at the headline bucket (and others), TPOT (every decode step), end-to-end; empty for
    results written before these were recorded."""
    latency = result.get("latency") or {}
    samples = {}
    ttft = latency.get("ttft_ms_by_bucket") or {}
    headline = str(result["prefill_bucket"])
    if headline in ttft:
        samples["ttft_ms"] = ttft[headline]
    for bucket, values in sorted(ttft.items(), key=lambda kv: int(kv[0])):
        if bucket != headline:
            samples[f"ttft_ms[{bucket}]"] = values
    steps = [ms for run in result.get("decode_steps_ms") or [] for ms in run]
    if steps and latency:
        samples["tpot_ms"] = steps
    if latency.get("e2e_ms"):
        samples["e2e_ms"] = latency["e2e_ms"]
    return samples


def budget_samples(result: dict) -> dict[str, list[float]]:
    """What a budget may name: the compared metrics and the latency vocabulary."""
    return {**metric_samples(result), **latency_samples(result)}


def finite_number(v) -> bool:
    """A JSON number a float can hold: not a bool, not NaN or infinite, and not an integer too long
    for a float (math.isfinite itself raises OverflowError on one)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if isinstance(v, int):
        return abs(v) <= MAX_FLOAT_INT
    return math.isfinite(v)


MAX_FLOAT_INT = int(1e300)  # far beyond any timing; keeps every sum and ratio of samples finite


def _finite_list(values) -> bool:
    return isinstance(values, list) and bool(values) and all(finite_number(v) for v in values)


def created_time(result: dict, source: str) -> datetime:
    """The run's creation time: an ISO date with its time zone (bench writes UTC). A date without
    one cannot be ordered against the others, so it is refused rather than guessed."""
    text = result.get("created")
    try:
        created = datetime.fromisoformat(text) if isinstance(text, str) else None
    except ValueError:
        created = None
    if created is None:
        raise HarnessInputError(f"{source}: created = {text!r} is not an ISO date; the file is corrupted or "
                                "was edited: re-run the benchmark")
    if created.tzinfo is None or created.utcoffset() is None:
        raise HarnessInputError(f"{source}: created = {text!r} has no time zone, so it cannot be ordered "
                                "against other runs; give it one (e.g. +00:00) or re-run the benchmark")
    return created


def validate_result(result, source: str) -> dict:
    """A loaded result must be format 1 with non-empty numeric samples; say what is wrong."""
    if not isinstance(result, dict) or result.get("format") != FORMAT:
        got = result.get("format") if isinstance(result, dict) else type(result).__name__
        raise HarnessInputError(f"{source}: not a perf result of format {FORMAT} (format {got!r}); "
                                "pass a file written by `gemma-parity bench`")
    for key in REQUIRED_KEYS:
        if key not in result:
            raise HarnessInputError(f"{source}: key {key!r} is missing; the file is incomplete or was "
                                    "not written by `gemma-parity bench`")
    if not isinstance(result["metrics"], dict) or not isinstance(result.get("prefill_ms_by_bucket", {}), dict):
        raise HarnessInputError(f"{source}: metrics and prefill_ms_by_bucket must be objects of sample "
                                "lists; the file was not written by `gemma-parity bench`")
    lists = {f"metrics.{name}": result["metrics"].get(name) for name in ("prefill_ms", "decode_ms_per_token")}
    lists.update({f"prefill_ms_by_bucket.{b}": v for b, v in result.get("prefill_ms_by_bucket", {}).items()})
    latency = result.get("latency") or {}
    if not isinstance(latency, dict) or not isinstance(latency.get("ttft_ms_by_bucket", {}), dict):
        raise HarnessInputError(f"{source}: latency must be an object; re-run the benchmark")
    lists.update({f"latency.ttft_ms_by_bucket.{b}": v for b, v in latency.get("ttft_ms_by_bucket", {}).items()})
    if "e2e_ms" in latency:
        lists["latency.e2e_ms"] = latency["e2e_ms"]
    steps = result.get("decode_steps_ms")
    if steps is not None and not isinstance(steps, list):
        raise HarnessInputError(f"{source}: decode_steps_ms must be a list of per-run step lists; re-run the benchmark")
    lists.update({f"decode_steps_ms[{k}]": run for k, run in enumerate(steps or [])})
    lists.update(length_lists(result))
    lists.update(batch_lists(result))
    for name, values in lists.items():
        if not _finite_list(values):
            raise HarnessInputError(f"{source}: {name} must be a non-empty list of finite numbers; "
                                    "re-run the benchmark")
    created_time(result, source)
    return result


def load_result(path) -> dict:
    path = Path(path)
    result = read_json_file(path, "perf result", HarnessInputError, "delete it or re-run the benchmark")
    return validate_result(result, str(path))


def write_text(path, text: str, overwrite: bool = False) -> Path:
    """Atomic, and without `overwrite` never over an existing file (see harness.base.atomic)."""
    return write_text_atomic(path, text, no_clobber=not overwrite)


def write_json(path, obj, overwrite: bool = False) -> Path:
    return write_json_atomic(path, obj, no_clobber=not overwrite, indent=1, sort_keys=True)


# ---- the history ------------------------------------------------------------------------------

def history_name(result: dict) -> str:
    created = created_time(result, "a perf result").astimezone(timezone.utc)
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
    runs = [(p, load_result(p)) for p in history_files(directory) if p.name != BASELINE_FILE]
    if not runs:
        raise HarnessInputError(f"{directory}: no run files (*.json); add one with "
                                f"`gemma-parity bench ... --history {directory}`")
    return sorted(runs, key=lambda run: (created_time(run[1], str(run[0])), run[0].name))


def history_files(directory: Path) -> list[Path]:
    """The run files of a history: regular files named *.json (a directory, pipe or device of that
    name is not a run, and reading a pipe would block for ever)."""
    return sorted(p for p in directory.glob("*.json") if p.is_file())


def skipped_history_entries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.json") if not p.is_file())


def _field(result: dict, dotted: str):
    value = result
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def mismatches(baseline: dict, current: dict) -> list[tuple[str, object, object]]:
    return [(f, _field(baseline, f), _field(current, f)) for f in COMPARABLE_FIELDS
            if _field(baseline, f) != _field(current, f)]


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _field_problem(data: dict, source: str) -> str | None:
    """The fields perf reads as numbers and dates: a wrong type there is a broken file."""
    from datetime import datetime

    for key in ("prefill_bucket", "tp"):
        if key in data and not _positive_int(data[key]):
            return f"{source}: {key} = {data[key]!r} is not a positive integer; the file is corrupted or was edited"
    if "created" in data:
        try:
            datetime.fromisoformat(data["created"])
        except (TypeError, ValueError):
            return f"{source}: created = {data['created']!r} is not an ISO date; the file is corrupted or was edited"
    buckets = data.get("prefill_ms_by_bucket")
    if isinstance(buckets, dict) and not all(str(b).isdigit() and int(b) > 0 for b in buckets):
        return f"{source}: prefill_ms_by_bucket keys {sorted(buckets)!r} must be bucket sizes; re-run the benchmark"
    return None


def sample_problem(data, source: str) -> str | None:
    """Timing samples must be positive: a zero or negative duration is a broken file, not a speed."""
    if not isinstance(data, dict):
        return None  # perf.validate_result names the structural problem
    problem = _field_problem(data, source)
    if problem:
        return problem
    lists = {f"metrics.{k}": val for k, val in (data.get("metrics") or {}).items()} if isinstance(
        data.get("metrics"), dict) else {}
    if isinstance(data.get("prefill_ms_by_bucket"), dict):
        lists.update({f"prefill_ms_by_bucket.{b}": val for b, val in data["prefill_ms_by_bucket"].items()})
    lists.update(length_lists(data))
    for name, values in lists.items():
        for i, x in enumerate(values if isinstance(values, list) else []):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 or x == float("inf"):
                return (f"{source}: {name}[{i}] = {x!r} is not a positive finite duration; the file is "
                        "corrupted or was edited: re-run the benchmark")
    return None
