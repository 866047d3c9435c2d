"""What a device run measures that no CPU can know, kept beside the compile cache so the next plan
reads it (harness/plan/calibration.py): per build, its kind (parity or served/perf), its graphs by
kind (context encoding, decode, verify, draft), the cold compile's wall time and workers (so minutes
per graph), its binaries' bytes, the compiler's peak host memory (the process's peak RSS while it
compiled, children included), and the device memory the runtime reports after the load; per run,
the measured decode and prefill times (`record_latency`, from bench).

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


def record_build(be, compile_seconds: float | None, device_bytes: int | None) -> None:
    """Append backend `be`'s build: its graphs by kind, and when it compiled here its wall time,
    workers and binaries' bytes (the entry's model file) and this process's peak host memory; the
    device bytes after load when the runtime reported them."""
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
        "device_bytes_after_load": device_bytes, "planned_core_bytes": be.build.core["total"]})
    _save(path, data)


def record_latency(cache_dir: Path | None, decode_ms: float, prefill_ms: dict) -> None:
    """The measured decode step and prefill per bucket (medians, ms) of a bench run."""
    path = calibration_path(cache_dir)
    data = load(path) or {"format": FORMAT, "source": f"inf2 run of {time.strftime('%Y-%m-%d')}", "builds": []}
    data["latency"] = {"decode_ms": decode_ms, "prefill_ms": {str(k): v for k, v in prefill_ms.items()}}
    _save(path, data)


__all__ = ["FILE", "FORMAT", "GRAPH_KINDS", "calibration_path", "graph_kind", "load", "record_build", "record_latency"]
