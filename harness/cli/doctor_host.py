"""`doctor`'s host checks: NeuronCores another process holds, free disk for the compile work
directory, host memory, and the device plan (harness/plan/instances.py) of the run about to start.

Cores in use come from `neuron-ls --json-output`: each device's `neuron_processes` (a process of
the Neuron runtime holds its device's cores; the field name is neuron-ls's JSON of SDK 2.x, which
Neuron 2.34 replaces). The disk and memory needs are estimates stated with their numbers: a cold
compile of the 12B's graphs writes several GiB per graph into the work directory
(COMPILE_DISK_BYTES), and the host holds every rank's weights while loading them plus the compiler
(COMPILER_HOST_BYTES per graph compiled at once).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

GIB = 1 << 30
COMPILE_DISK_BYTES = 20 * GIB  # free disk the compile work directory needs (an estimate)
COMPILER_HOST_BYTES = 16 * GIB  # host memory one neuronx-cc run on a 12B-sized graph takes (an estimate)


def busy_cores(neuron_ls_json: str, own_pid: int) -> list[tuple[int, int, list]]:
    """(device, its cores, [pids]) of every device another process's Neuron runtime holds."""
    busy = []
    for device in json.loads(neuron_ls_json):
        pids = [p.get("pid") for p in device.get("neuron_processes") or [] if p.get("pid") != own_pid]
        if pids:
            busy.append((int(device.get("neuron_device", len(busy))), int(device.get("nc_count", 0)), pids))
    return busy


def cores_in_use_check(neuron_ls_json: str | None, total: int, tp: int, check, own_pid: int | None = None):
    if neuron_ls_json is None:
        return check("cores in use", False, "neuron-ls gave no readable listing (see its line above)")
    busy = busy_cores(neuron_ls_json, os.getpid() if own_pid is None else own_pid)
    held = sum(cores for _, cores, _ in busy)
    if held and total - held < tp:  # too few cores in all is the `cores` line's
        where = "; ".join(f"device {d} ({c} cores) by pid {', '.join(map(str, p))}" for d, c, p in busy)
        return check("cores in use", False, f"tp={tp} needs {tp} free NeuronCores but {held} of {total} are held: "
                     f"{where}; fix: stop those processes (or wait for them) or use other cores "
                     "(NEURON_RT_VISIBLE_CORES)")
    return check("cores in use", True, f"{total - held} of {total} NeuronCores free"
                 + (f" ({held} held by other processes)" if held else ""))


def disk_check(work_dir: Path, check, need: int | None = None):
    need = COMPILE_DISK_BYTES if need is None else need
    probe = Path(work_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        return check("disk", False, f"{free / GIB:.1f} GiB free under {work_dir} (the compile work directory), a "
                     f"cold compile needs about {need / GIB:.0f} GiB; fix: free space there or point "
                     "GEMMA_PARITY_NEURON_CACHE at a larger disk")
    return check("disk", True, f"{free / GIB:.1f} GiB free under {work_dir} (about {need / GIB:.0f} GiB needed)")


def read_meminfo() -> str | None:
    try:
        return Path("/proc/meminfo").read_text()
    except OSError:
        return None


def available_memory(meminfo: str) -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemAvailable line")


def memory_check(meminfo: str | None, weights_all_ranks: int, check, workers: int = 1):
    if meminfo is None:
        return check("host memory", True, "/proc/meminfo unreadable: host memory not checked", True)
    free = available_memory(meminfo)
    need = weights_all_ranks + workers * COMPILER_HOST_BYTES
    line = (f"{free / GIB:.1f} GiB available; the run needs about {need / GIB:.1f} GiB (every rank's weights "
            f"{weights_all_ranks / GIB:.1f} while loading + {workers} compile(s) at {COMPILER_HOST_BYTES / GIB:.0f})")
    if free < need:
        return check("host memory", False, f"{line}; fix: a larger instance, fewer processes on this host, or "
                     "--backend-option compile_workers=1")
    return check("host memory", True, line)


def plan_check(spec, tp: int, dtype: str, kv_len: int, check, sliding_cache: str = "linear", **build):
    """The device plan of the run (instances.check_fits: weights, KV of its slots, every graph of
    its build, MoE, the layout transform when on); `build`: core_bytes' keywords (buckets, batch,
    speculate, layout) of the run's options."""
    from harness.base.errors import ShardingError
    from harness.plan.instances import check_fits, core_summary

    try:
        where = check_fits(spec, tp, dtype, kv_len, sliding_cache, **build)
    except ShardingError as exc:
        return check("HBM", False, str(exc))
    from harness.plan.calibration import read_calibration

    measured = read_calibration().get("device") or []
    after = "; ".join(f"a {d['kind']} build measured {d['after_load'] / GIB:.2f} GiB after load" for d in measured)
    return check("HBM", True, f"per core {where['bytes_per_rank'] / GIB:.2f} GiB of 16 GiB: fits ("
                 f"{core_summary(where['core'])}{', int8 weights' if build.get('quantize') else ''}); "
                 + (f"calibration: {after}" if after else "planned, not measured (no calibration kept)"),
                 where["tight"])
