"""The environment a bench run was timed in, and the one rule that says whether two runs' timings can
be compared at all (docs/performance.md#comparable-runs).

A shared machine (a CI runner, a workstation several people use) slows a run by what else runs on it,
and the rank test then finds a real difference between the two runs' samples: the machine's, not the
code's. So every bench result records, over its own run (from its first warm-up to its last sample):

  others_cpu  the share of the machine's CPU time (all cores, the whole run) that other processes
              used: the busy time /proc/stat counts, minus this process's own CPU time;
  steal       the share the hypervisor gave to other guests (/proc/stat's steal column);
  cpu_mhz     the cores' mean clock (/proc/cpuinfo), at the end;
  cpu_stall   the share of the run during which some task waited for a CPU (/proc/pressure/cpu),
              where the kernel reports it;
  load_1m     the 1-minute load average at the start and at the end.

Two runs are comparable only when neither had more than LIMITS of the machine taken by other work
(then its samples measure the machine: on a busy 2-core machine two benches of identical code, both
with others_cpu near 0.8, differed by 26%), their others_cpu and steal differ by at most BOUNDS'
points, their cpu_mhz by at most BOUNDS' fraction, and the CPU bench's measured rates are not apart by
more than RATE_BOUND. Otherwise `perf compare` calls no metric slower or faster and exits 2 ("not
comparable"). The load average is recorded and printed but not judged: it
lags a minute behind (the second of two back-to-back benches starts with the first one's load) and
counts the bench's own threads. A result without the record (written before it existed) is
compared as before, with a note.
"""

from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_CPUINFO = Path("/proc/cpuinfo")
PROC_PSI = Path("/proc/pressure/cpu")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# The rule's bounds. LIMITS: the most of the machine's CPU time (all cores, the whole run) other work may
# take for a run to be a measurement at all. BOUNDS: how far two runs may differ, in points of the CPU
# for the shares and as a fraction of the clock. RATE_BOUND: how far apart the CPU bench's measured
# memory bandwidth or matmul rate may be (beyond both runs' spreads).
LIMITS = {"others_cpu": 0.25, "steal": 0.10}
BOUNDS = {"others_cpu": 0.10, "steal": 0.05, "cpu_mhz": 0.05}
RATE_BOUND = 0.20
FIELDS = ("others_cpu", "steal", "cpu_mhz", "cpu_stall", "load_1m", "cores", "window_s")


def _stat() -> tuple[float, float] | None:
    """(busy seconds, steal seconds) of all cores since boot, or None where /proc/stat is unreadable."""
    try:
        fields = PROC_STAT.read_text().splitlines()[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    except (OSError, IndexError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / TICKS, steal / TICKS


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _psi_total() -> float | None:
    """Seconds some task waited for a CPU since boot (the kernel's pressure stall information)."""
    try:
        for line in PROC_PSI.read_text().splitlines():
            if line.startswith("some"):
                return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        pass
    return None


def _mhz() -> float | None:
    try:
        values = [float(line.split(":", 1)[1]) for line in PROC_CPUINFO.read_text().splitlines()
                  if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        return None
    return sum(values) / len(values) if values else None


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def probe() -> dict:
    """The counters now; `since(probe())` at the end of the run turns them into its record."""
    return {"wall": time.monotonic(), "stat": _stat(), "own": _own_cpu(), "psi": _psi_total(), "load": _load()}


def since(start: dict) -> dict:
    """The run's environment record (the module docstring), from `start` (a probe) to now."""
    end = probe()
    cores = os.cpu_count() or 1
    window = max(end["wall"] - start["wall"], 1e-9)
    record = {"window_s": round(window, 3), "cores": cores, "load_1m": [start["load"], end["load"]],
              "cpu_mhz": _mhz(), "others_cpu": None, "steal": None, "cpu_stall": None}
    if start["stat"] and end["stat"]:
        capacity = window * cores
        busy = end["stat"][0] - start["stat"][0]
        others = busy - (end["own"] - start["own"])
        record["others_cpu"] = round(min(max(others / capacity, 0.0), 1.0), 4)
        record["steal"] = round(min(max((end["stat"][1] - start["stat"][1]) / capacity, 0.0), 1.0), 4)
    if start["psi"] is not None and end["psi"] is not None:
        record["cpu_stall"] = round(min(max((end["psi"] - start["psi"]) / window, 0.0), 1.0), 4)
    return record


def describe(env: dict | None) -> str:
    """One line: what the run shared its machine with."""
    if not isinstance(env, dict):
        return "environment not recorded"
    parts = []
    for key, label in (("others_cpu", "other processes"), ("steal", "steal")):
        if isinstance(env.get(key), (int, float)):
            parts.append(f"{label} {env[key]:.0%} of the CPU")
    if isinstance(env.get("cpu_mhz"), (int, float)):
        parts.append(f"{env['cpu_mhz']:.0f} MHz")
    load = env.get("load_1m")
    if isinstance(load, list) and all(isinstance(x, (int, float)) for x in load):
        parts.append(f"load {load[0]:.2f} -> {load[1]:.2f} on {env.get('cores')} cores")
    return ", ".join(parts) or "environment not recorded"


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def busy(env: dict | None, label: str) -> list[str]:
    """Why one run is no measurement at all: other processes or other guests took more than
    LIMITS of the machine while it ran ([] when it was quiet enough, or has no record)."""
    found = []
    for key, what in (("others_cpu", "other processes"), ("steal", "other guests (steal)")):
        value = env.get(key) if isinstance(env, dict) else None
        if _num(value) and value > LIMITS[key]:
            found.append(f"{what} took {value:.0%} of the CPU during {label} (limit {LIMITS[key]:.0%})")
    return found


def differences(baseline: dict | None, current: dict | None) -> list[str] | None:
    """Where the two runs' environments differ beyond BOUNDS ([] when within them), or None when
    either run has no record (nothing to judge)."""
    if not (isinstance(baseline, dict) and isinstance(current, dict)):
        return None
    found = []
    for key in ("others_cpu", "steal"):
        a, b = baseline.get(key), current.get(key)
        if _num(a) and _num(b) and abs(a - b) > BOUNDS[key]:
            found.append(f"{'other processes' if key == 'others_cpu' else 'steal'} used {a:.0%} vs {b:.0%} of "
                         f"the CPU (bound {BOUNDS[key]:.0%} points)")
    a, b = baseline.get("cpu_mhz"), current.get("cpu_mhz")
    if _num(a) and _num(b) and min(a, b) > 0 and max(a, b) / min(a, b) - 1 > BOUNDS["cpu_mhz"]:
        found.append(f"the clock was {a:.0f} vs {b:.0f} MHz (bound {BOUNDS['cpu_mhz']:.0%})")
    return found


def rate_differences(baseline: dict, current: dict) -> list[tuple[str, float, float, bool]]:
    """(what, baseline median, current median, beyond RATE_BOUND) for each rate the CPU bench measured
    on both machines whose samples do not overlap (the rates' spreads, perf/bench.py)."""
    spreads = [((r.get("roofline") or {}).get("rates_spread") or {}) for r in (baseline, current)]
    out = []
    for key, what in (("memory_bytes_per_s", "memory bandwidth"), ("flops_per_s", "matmul rate")):
        a, b = (s.get(key) if isinstance(s, dict) else None for s in spreads)
        try:
            if a["max"] < b["min"] or b["max"] < a["min"]:
                ratio = max(a["median"], b["median"]) / min(a["median"], b["median"])
                out.append((what, a["median"], b["median"], ratio - 1 > RATE_BOUND))
        except (KeyError, TypeError, ZeroDivisionError):
            continue
    return out


def not_comparable(baseline: dict, current: dict, baseline_label: str = "baseline",
                   current_label: str = "current") -> str | None:
    """The verdict line when the two bench results cannot be compared (the module docstring), else None."""
    benv, cenv = baseline.get("environment"), current.get("environment")
    found = busy(benv, baseline_label) + busy(cenv, current_label) + (differences(benv, cenv) or [])
    found += [f"the machines measured {what} {a:.3g} vs {b:.3g}, beyond both spreads and {RATE_BOUND:.0%} apart"
              for what, a, b, beyond in rate_differences(baseline, current) if beyond]
    if not found:
        return None
    return (f"not comparable: the machine's other work differed or was too much: {'; '.join(found)}. No metric is "
            "called slower or faster (exit 2); rerun both when the machine is quieter, or on a machine of their "
            "own (docs/performance.md#comparable-runs)")


def judge_environment(comp, baseline: dict, current: dict, baseline_label: str | None = None) -> None:
    """Withhold every metric's verdict of `comp` (a perf.compare.Comparison) when the two runs are not
    comparable; say so in a note when either run has no environment record."""
    reason = not_comparable(baseline, current, baseline_label or comp.baseline_label, comp.current_label)
    if differences(baseline.get("environment"), current.get("environment")) is None:
        comp.notes.append("environment: not recorded in both runs (a result written before bench recorded the "
                          "machine's other work), so their load was not compared")
    else:
        comp.notes.append(f"environment: baseline {describe(baseline.get('environment'))}; current "
                      f"{describe(current.get('environment'))}")
    if reason is None:
        return
    comp.not_comparable = reason
    for m in comp.metrics:
        if m.ratio is not None and not m.verdict.startswith("not compared"):
            m.regressed = m.improved = False
            m.verdict = "not compared: the machine differed"


def alike(runs: list, newest: dict) -> list:
    """The (path, result) runs comparable with the newest (a run without a record counts as alike:
    nothing to judge)."""
    return [(p, r) for p, r in runs if not_comparable(r, newest) is None]
