"""The machine and the software a run was made on, and this machine's measured memory bandwidth and
matmul throughput (the CPU backend's roofline figures: measured, never assumed)."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

VERSION_PACKAGES = ("torch", "transformers", "safetensors", "numpy", "scipy", "gemma-parity",
                    "torch-neuronx", "neuronx-cc", "neuronx-distributed", "libneuronxla", "torch-xla")
# EC2 reports the instance type as the DMI product name (e.g. "inf2.8xlarge").
DMI_PRODUCT = Path("/sys/devices/virtual/dmi/id/product_name")
INSTANCE_TYPE_ENV = "GEMMA_PARITY_INSTANCE_TYPE"
BANDWIDTH_BYTES, BANDWIDTH_REPEATS = 256 * 2**20, 5
MATMUL_SIZE, MATMUL_REPEATS = 1024, 3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def neuron_core_count() -> int:
    """NeuronCores on this host, counted as the Neuron backend counts them (0 without the driver).
    Importing the backend needs no Neuron SDK."""
    from harness.backends.neuron import neuron_core_count as count

    try:
        return int(count())
    except Exception:  # a host without the Neuron driver: no cores to count
        return 0


def instance_type() -> str | None:
    """The EC2 instance type ($GEMMA_PARITY_INSTANCE_TYPE, else the DMI product name), or None."""
    if os.environ.get(INSTANCE_TYPE_ENV):
        return os.environ[INSTANCE_TYPE_ENV]
    try:
        name = DMI_PRODUCT.read_text().strip()
    except OSError:
        return None
    return name if "." in name else None


def machine_info() -> dict:
    return {"cpu_model": cpu_model(), "cores": os.cpu_count() or 0,
            "neuron_cores": neuron_core_count(), "hostname": socket.gethostname(),
            "instance_type": instance_type()}


def package_versions() -> dict:
    found = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def git_commit() -> str:
    """The commit of the tree (provenance.git_state, the one home: "unknown" or $GITHUB_SHA outside a
    checkout of its own, e.g. an installed wheel or a source archive)."""
    from harness.base.provenance import git_state

    return git_state()["commit"]


def _median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # first touch: page faults and allocator warm-up are not bandwidth
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), samples


def measure_memory_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = BANDWIDTH_REPEATS) -> dict:
    """Bytes per second of a large tensor copy (read + write = 2 x nbytes moved), median of
    `repeats`, with torch's threads: what the CPU backend's weight reads can reach at best."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds, samples = _median_seconds(lambda: dst.copy_(src), repeats)
    return {"bytes_per_s": 2 * nbytes / seconds, "method": f"copy of {nbytes / 2**20:.0f} MiB, median of "
            f"{repeats}", "seconds": samples}


def measure_matmul_flops(dtype="bf16", size: int = MATMUL_SIZE, repeats: int = MATMUL_REPEATS) -> dict:
    """FLOP/s of a square matmul in the run's dtype, median of `repeats` (the CPU's compute peak
    as torch reaches it)."""
    import torch

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(size, size).to(torch_dtype)
    b = torch.randn(size, size).to(torch_dtype)
    seconds, samples = _median_seconds(lambda: a @ b, repeats)
    return {"flops_per_s": 2 * size**3 / seconds, "method": f"{size}x{size} {dtype} matmul, median of "
            f"{repeats}", "seconds": samples}
