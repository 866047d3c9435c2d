"""Result files (format 1) and the run history: their validation and atomic writes (their metrics as
sample lists: harness/perf/samples.py).

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
from harness.perf.samples import batch_lists, length_lists

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
