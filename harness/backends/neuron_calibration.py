"""What a device run measures that no CPU can know, kept beside the compile cache so the next plan
reads it (harness/plan/calibration.py): per build, its kind (parity or served/perf), its graphs by
kind (context encoding, decode, verify, draft), the cold compile's wall time and workers (so minutes
per graph), its binaries' bytes, the compiler's peak host memory (the process's peak RSS while it
compiled, children included), and the device memory its load took on each NeuronCore (the Neuron
driver's sysfs counters, read before and after: `device_bytes_in_use`); per run, the measured
decode and prefill times (`record_latency`, from bench).

One JSON file, `calibration.json` in the compile cache directory (the inf2 workflow keeps that
directory between runs). Each record says where it came from (`source`); a file marked `"fixture":
true` is a test's, never a measurement, and is refused outside tests.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from harness.base.atomic import write_json_atomic
from harness.base.errors import HarnessInputError

FORMAT = 1
FILE = "calibration.json"
GRAPH_KINDS = ("context_encoding", "decode", "verify", "draft")
# The Neuron driver's per-core counters (docs/neuron.md, the first run): neuron{D}/core_count, and per
# core neuron{D}/neuron_core{C}/stats/memory_usage/device_mem/<category>/total, each the bytes in use now.
SYSFS_ROOT = Path("/sys/devices/virtual/neuron_device")


def calibration_path(cache_dir: Path | None = None) -> Path:
    from harness.backends.neuron_cache import default_cache_dir

    return Path(os.environ.get("GEMMA_PARITY_CALIBRATION") or (cache_dir or default_cache_dir()) / FILE)


def graph_kind(tag: str) -> str:
    """The kind of a ModelBuilder tag: prefill buckets are context encoding; decode, verify, draft."""
    for prefix, kind in (("prefill", "context_encoding"), ("decode", "decode"), ("verify", "verify"), ("draft", "draft")):
        if tag.startswith(prefix):
            return kind
    return "other"


def load(path: Path) -> dict:
    """The calibration at `path` ({} when none was kept), refused with the fix when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HarnessInputError(f"{path}: unreadable calibration ({exc}); delete it (the next device run "
                                "records it again)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise HarnessInputError(f"{path}: calibration format {data.get('format') if isinstance(data, dict) else None!r}, "
                                f"not {FORMAT}; delete it (the next device run records it again)")
    return data


def _save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def _counter(path: Path) -> int:
    return int(path.read_text().split()[0])


def _device_mem(path: Path) -> int:
    """A core's device_mem counter: its own `total` where the driver keeps one, else its categories' sum."""
    if (path / "total").is_file():
        return _counter(path / "total")
    totals = [_counter(d / "total") for d in sorted(path.iterdir()) if (d / "total").is_file()]
    if not totals:
        raise ValueError(f"{path}: no memory counters")
    return sum(totals)


def device_bytes_in_use(tp: int, environ=None) -> dict[int, int] | None:
    """{core: bytes of device memory in use now} for the build's NeuronCores (the first `tp` of
    NEURON_RT_VISIBLE_CORES, else 0..tp-1), from the driver's counters (SYSFS_ROOT, cores numbered
    device by device); None when they cannot be read (no Neuron driver here, or a driver whose tree
    is laid out otherwise): nothing is recorded rather than a guess."""
    from harness.backends.neuron_env import parse_visible_cores

    visible = (os.environ if environ is None else environ).get("NEURON_RT_VISIBLE_CORES")
    try:
        devices = sorted((d for d in SYSFS_ROOT.glob("neuron*") if d.name[6:].isdigit()), key=lambda d: int(d.name[6:]))
        cores = [d / f"neuron_core{c}" for d in devices for c in range(_counter(d / "core_count"))]
        ids = (parse_visible_cores(visible) if visible else list(range(tp)))[:tp]
        return {c: _device_mem(cores[c] / "stats" / "memory_usage" / "device_mem") for c in ids}
    except (OSError, ValueError, IndexError, HarnessInputError):
        return None


def record_build(be, compile_seconds: float | None, before: dict | None, after: dict | None) -> None:
    """Append backend `be`'s build: its graphs by kind, and when it compiled here its wall time,
    workers and binaries' bytes (the entry's model file) and this process's peak host memory; the
    device bytes its load took on its fullest core (device_bytes_in_use `after` less `before`: what
    the process already held on that core is not this build's), with both readings."""
    path = calibration_path(be.cache_dir)
    data = load(path) or {"format": FORMAT, "source": f"inf2 run of {time.strftime('%Y-%m-%d')}", "builds": []}
    kinds: dict[str, int] = {}
    for tag in {**be.kv_graphs, **be.draft_graphs}:
        kinds[graph_kind(tag)] = kinds.get(graph_kind(tag), 0) + 1
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the compiler runs as children
    model = be.artifact_dir / "nxd_model.pt"
    data["builds"] = data["builds"][-49:]  # the newest 50: a run per build kind and key is what the plan reads
    data["builds"].append({
        "kind": "parity" if be.capture else "served", "key": be.cache_key, "graphs": kinds,
        "compile_seconds": compile_seconds, "workers": be.compile_workers,
        "binary_bytes": model.stat().st_size if compile_seconds is not None and model.is_file() else None,
        "peak_host_bytes": peak if compile_seconds is not None else None,
        "device_bytes_after_load": max(n - (before or {}).get(c, 0) for c, n in after.items()) if after else None,
        "device_bytes_by_core": {"before": before, "after": after}, "planned_core_bytes": be.build.core["total"]})
    _save(path, data)


def record_latency(cache_dir: Path | None, decode_ms: float, prefill_ms: dict) -> None:
    """The measured decode step and prefill per bucket (medians, ms) of a bench run."""
    path = calibration_path(cache_dir)
    data = load(path) or {"format": FORMAT, "source": f"inf2 run of {time.strftime('%Y-%m-%d')}", "builds": []}
    data["latency"] = {"decode_ms": decode_ms, "prefill_ms": {str(k): v for k, v in prefill_ms.items()}}
    _save(path, data)


__all__ = ["FILE", "FORMAT", "GRAPH_KINDS", "SYSFS_ROOT", "calibration_path", "device_bytes_in_use", "graph_kind", "load",
           "record_build", "record_latency"]
