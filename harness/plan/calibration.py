"""The first inf2 run's measurements, read for the plan (harness/backends/neuron_calibration.py keeps
them beside the compile cache): compile minutes per graph by build and graph kind, the compiler's
peak host memory, each build's device memory after load against its plan, the measured decode and
prefill times. `info --plan`, `doctor` and the compile budget use a measured figure where one exists
and say which (`describe`); a file marked as a test fixture is labelled so on every line.
"""

from __future__ import annotations

from harness.backends.neuron_calibration import calibration_path, load


def read_calibration(path=None) -> dict:
    """{} when no calibration was kept, else its figures: `compile` {minutes_per_graph: {"parity/decode":
    minutes, ...}, peak_host_bytes}, `device` [{kind, after_load, planned}], `latency`, `source`."""
    data = load(path or calibration_path())
    if not data:
        return {}
    minutes, peaks, device = {}, [], []
    for b in data.get("builds", []):
        graphs = sum(b.get("graphs", {}).values())
        if b.get("compile_seconds") and graphs:
            # ModelBuilder compiles a build's graphs together: wall time x workers / graphs, per kind present
            per = b["compile_seconds"] * (b.get("workers") or 1) / graphs / 60
            for kind in b["graphs"]:
                key = f"{b['kind']}/{kind}"
                minutes[key] = max(minutes.get(key, 0.0), round(per, 2))
        if b.get("peak_host_bytes"):
            peaks.append(b["peak_host_bytes"])
        if b.get("device_bytes_after_load"):
            device.append({"kind": b["kind"], "after_load": b["device_bytes_after_load"],
                           "planned": b.get("planned_core_bytes")})
    source = data.get("source", str(path))
    if data.get("fixture"):
        source = f"TEST FIXTURE, not a measurement: {source}"
    return {"source": source, "fixture": bool(data.get("fixture")), "device": device, "latency": data.get("latency"),
            "compile": {"minutes_per_graph": minutes, "peak_host_bytes": max(peaks) if peaks else None}}


def describe(calibration: dict) -> list[str]:
    """What the plan takes from the calibration, one line each, or that it has none."""
    if not calibration:
        return ["calibration: none kept (the first inf2 run records one beside the compile cache); the compile "
                "budget's figures are published or estimated, the device fit's reserve an estimate"]
    c = calibration["compile"]
    lines = [f"calibration ({calibration['source']}): compile minutes per graph "
             + (", ".join(f"{k} {v:g}" for k, v in sorted(c["minutes_per_graph"].items())) or "not measured")
             + (f"; compiler peak host memory {c['peak_host_bytes'] / 2**30:.1f} GiB" if c["peak_host_bytes"] else "")]
    for d in calibration["device"]:
        planned = f" (planned {d['planned'] / 2**30:.2f})" if d.get("planned") else ""
        lines.append(f"calibration: {d['kind']} build measured {d['after_load'] / 2**30:.2f} GiB per core after load{planned}")
    if calibration.get("latency"):
        lat = calibration["latency"]
        lines.append(f"calibration: measured decode {lat['decode_ms']:g} ms/token, prefill "
                     + ", ".join(f"{k}: {v:g} ms" for k, v in lat.get("prefill_ms", {}).items()))
    return lines


__all__ = ["describe", "read_calibration"]
