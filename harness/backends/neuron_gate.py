"""The one gate every Neuron build passes before tracing (NeuronBackend.__init__): whoever asks for it
(a command, an extra stage, a test marked `neuron`, a benchmark), the build's graphs are counted
from the tags it will trace and its memory per NeuronCore by the one device fit
(harness/port/core_fit.py core_bytes, the fit every plan prints); a build over a core is refused
before any compile, and a cold build is counted against the run's stated budget.

The run's budget (`LEDGER.state`) is what its plan counted: a command states its plan's graphs
(harness/cli/host_gate.py). A cold build past it is a build outside the plan and is refused before
it compiles; with no budget stated (a test session: the device job's `neuron` tests declare their
builds, counted by tests/unit/test_inf2_budget.py) every build is still fitted and recorded. `LEDGER.builds` is what
the run built, in order (the plan's tests compare it with the plan; the calibration run records it).
How many of a build's graphs compile at once (`compile_workers`) is decided here too: the backend
passes it to ModelBuilder and the compile budget (harness/plan/compile_budget.py) divides by it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from harness.base.errors import ShardingError
from harness.port.core_fit import CORE_HBM, core_bytes

GiB = 1 << 30


# Compile workers. ModelBuilder compiles the non-priority graphs on a thread pool (max_workers None:
# Python's default pool), one neuronx-cc process per graph; the traced HLO holds no weights
# (inline_weights_to_neff=False), so a compile's host memory is its graph's, beside the process that
# traced it (one rank's weights). The figure per compile is an estimate, not measured (nothing
# published gives neuronx-cc's peak for a graph of this size); the first inf2 run measures it
# (harness/plan/calibration.py) and the plan uses the measurement where one exists.
COMPILE_PEAK_HOST_BYTES = 8 * 2**30
CPUS_PER_COMPILE = 2  # neuronx-cc runs its own threads: half the vCPUs at most, as compiles at once


def compile_workers(host_bytes: int, cpus: int, held_bytes: int, peak_bytes: int = COMPILE_PEAK_HOST_BYTES) -> tuple[int, str]:
    """(graphs compiled at once, why): as many as the host's memory beside what the process holds and
    its cores allow, at least 1."""
    by_memory = max((host_bytes - held_bytes) // max(peak_bytes, 1), 1)
    by_cores = max(cpus // CPUS_PER_COMPILE, 1)
    workers = int(min(by_memory, by_cores))
    return workers, (f"{workers} at once: {host_bytes / 2**30:.0f} GiB of host memory less {held_bytes / 2**30:.1f} GiB "
                     f"held, at {peak_bytes / 2**30:.1f} GiB per compile, allows {by_memory}; {cpus} vCPUs at "
                     f"{CPUS_PER_COMPILE} per compile allow {by_cores}")


def default_compile_workers(weight_bytes_per_rank: int) -> tuple[int, str]:
    """compile_workers on this host: its physical memory and vCPUs, the traced rank's weights held."""
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1, "1 at once: this host does not report its memory"
    return compile_workers(host, os.cpu_count() or 1, weight_bytes_per_rank)



@dataclass
class Build:
    """One device build as the gate admitted it."""

    kind: str  # "parity" (captures) or "perf"
    graphs: int  # the graphs it traces (its kv tags and draft tags)
    cold: bool  # compiled here (no cache entry), not loaded
    core: dict  # core_fit.core_bytes of the build
    key: str = ""  # its artifact-cache key


@dataclass
class BuildLedger:
    """The run's device builds and the budget they are counted against."""

    stated_graphs: int | None = None  # the cold graphs the run's plan allows; None: none stated
    source: str = ""  # who stated it (the command and its plan, or the test session)
    builds: list[Build] = field(default_factory=list)

    def state(self, graphs: int | None, source: str) -> None:
        """The run's budget: `graphs` cold graphs at most (None: no budget), and who stated it."""
        self.stated_graphs, self.source, self.builds = graphs, source, []

    @property
    def compiled(self) -> int:
        return sum(b.graphs for b in self.builds if b.cold)

    def admit(self, build: Build) -> None:
        """Refuse a build over a core or, cold, past the stated budget; else record it."""
        core = build.core
        if core["total"] > CORE_HBM:
            raise ShardingError(
                f"a {build.kind} build of {build.graphs} graphs needs {core['total'] / GiB:.2f} GiB per NeuronCore "
                f"(weights {core['weights'] / GiB:.2f}, KV {core['kv_cache'] / GiB:.2f}, graphs "
                f"{core['graph_bytes'] / GiB:.2f}, runtime reserve {core['reserve'] / GiB:.2f}), over a core's "
                f"{CORE_HBM / GiB:.0f} GiB: refused before tracing (`gemma-parity info --plan` shows the fit; use a "
                "larger --tp, a shorter --kv-len, fewer buckets or --quantize int8)")
        if build.cold and self.stated_graphs is not None and self.compiled + build.graphs > self.stated_graphs:
            made = ", ".join(f"{b.kind} {b.graphs}{'' if b.cold else ' (cached)'}" for b in self.builds) or "none"
            raise ShardingError(
                f"a cold {build.kind} build of {build.graphs} graphs is outside the run's plan: {self.source} "
                f"planned {self.stated_graphs} cold graphs and {self.compiled} are compiled already (builds so far: "
                f"{made}); refused before tracing. Plan the build (harness/plan/compile_budget.py) or drop it")
        self.builds.append(build)


LEDGER = BuildLedger()


def admit_build(be, quantize: str | None) -> Build:
    """Fit and count backend `be`'s build (its settings already resolved, nothing traced yet); the
    fit's graph count must be the tags the build traces, or the plan and the build disagree."""
    dtype = str(be.dtype).removeprefix("torch.")
    core = core_bytes(be.spec, be.tp, dtype, be.max_len, be.sliding_cache, buckets=be.buckets,
                      layout=be.priority_key is not None, speculate=be.speculate,
                      assistant=be.assistant.spec if be.assistant is not None else None, batch=be.slots,
                      perf=not be.capture, quantize=quantize)
    traced = len(be.kv_graphs) + len(be.draft_graphs)
    if core["graphs"] != traced:
        raise ShardingError(f"the device fit counts {core['graphs']} graphs but this build traces {traced} "
                            f"({sorted({**be.kv_graphs, **be.draft_graphs})[:6]} ...): the plan and the build disagree")
    build = Build("parity" if be.capture else "perf", traced, not be.artifact_dir.exists(), core, be.cache_key)
    LEDGER.admit(build)
    return build


__all__ = ["COMPILE_PEAK_HOST_BYTES", "LEDGER", "Build", "BuildLedger", "admit_build", "compile_workers",
           "default_compile_workers"]
