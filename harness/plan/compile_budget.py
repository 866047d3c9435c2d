"""The cold-compile budget of a device command: which builds it compiles (`graphs_by_stage`: build
name -> compiled graphs), and the minutes those graphs take to compile cold, with the source of the
per-graph figure.

Graphs per build come from the same plan the backends trace (port/device_plan.graph_shapes, the
KV graph plan: each prefill bucket at each KV bucket holding it, decode at every KV bucket, a
verify graph with --speculate) times the batch buckets of a batched build (graphs.batch_buckets),
plus an assistant's draft graphs once (one sequence drafts per call).

The budget is ceil(graphs / workers) x minutes per graph: ModelBuilder compiles the graphs on a
pool of `workers` (neuron_gate.compile_workers, from the instance's host memory and vCPUs; the
reason is printed). Per-graph minutes: measured by the first inf2 run where a calibration exists
(harness/plan/calibration.py), else published, and said so: aws-neuron-sdk issue 1210 reports an
8B forward graph compiling in about 1 minute without its ArgMax (22 with it, 5 before a 2025
compiler regression); the port's graphs hold no ArgMax, so 5 minutes a graph is a margin over the
published figure, not a measurement.
"""

from __future__ import annotations

from harness.port.device_plan import graph_shapes
from harness.port.graphs import batch_buckets

PUBLISHED_MINUTES_PER_GRAPH = 5.0  # margin over issue 1210's ArgMax-free ~1 min; unmeasured here
PUBLISHED_SOURCE = ("published, not measured by this project: an 8B forward graph without ArgMax compiles in "
                    "about 1 min (aws-neuron-sdk issue 1210, where an ArgMax made it 22); 5 min taken as a margin")
# The batch stage of a check without --batch: its KV slots (parity/batched.py's MAX_STAGE_SLOTS, the
# most it uses), so the batch buckets 1, 2, 4.
BATCH_STAGE_SLOTS = 4
DEVICE_COMMANDS = ("check", "bisect", "quality", "bench")
INF2_8XLARGE_HOST, INF2_8XLARGE_VCPUS = 128 * 2**30, 32  # AWS, Inf2 instances


def graphs_by_stage(command: str, buckets, kv_len: int, *, batch: int | None = None, speculate: int = 0,
                    drafts: bool = False, served: bool = True) -> dict[str, int]:
    """Build name -> graphs it compiles, for `command` with these options: `batch` None is a check
    without --batch (batch 1, then the batch stage), 1 batch 1 only, N a build of N KV slots;
    `served` False is --skip-served-build. reference compiles nothing."""
    if command not in DEVICE_COMMANDS:
        return {}
    one = len(graph_shapes(buckets, kv_len, speculate, drafts))
    draft = len(graph_shapes(buckets, kv_len, 0, drafts)) - len(graph_shapes(buckets, kv_len))  # per KV bucket

    def batched(slots: int, speculating: bool = False) -> int:
        """A build of `slots` KV slots: every graph at each batch bucket, a draft graph once."""
        per_bucket = len(graph_shapes(buckets, kv_len, speculate if speculating else 0))
        return per_bucket * len(batch_buckets(slots)) + (draft if speculating else 0)

    slots = batch or 1
    main = batched(slots, speculating=True) if slots > 1 else one  # the batch stage neither verifies nor drafts
    if command == "bench":  # with an assistant and --batch N > 1, the speculative block times a batch-1 build first
        return {"perf build": main, **({"speculative perf build": one} if drafts and speculate and slots > 1 else {})}
    stages = {"parity build": main}
    if command != "check":
        return stages
    if batch is None:
        stages["batch stage"] = batched(BATCH_STAGE_SLOTS)
    if served:
        stages["served build"] = main
    return stages


def compile_minutes(graphs, weight_bytes_per_rank: int, *, host_bytes: int | None = None, cpus: int | None = None,
                    calibration: dict | None = None) -> dict:
    """{minutes, per_graph, workers, workers_reason, source, basis} of compiling `graphs` cold (a count,
    or each build's count: builds compile one after another) on a host of `host_bytes` and `cpus`
    vCPUs (default: an inf2.8xlarge), ceil(graphs / workers) rounds of the per-graph figure a build; `calibration` (calibration.read) gives measured figures where it has them
    (the slowest graph kind's minutes, the compiler's peak host memory). `basis` says in a few words
    whether the figures were measured."""
    from harness.backends.neuron_gate import COMPILE_PEAK_HOST_BYTES, compile_workers

    measured = (calibration or {}).get("compile", {})
    peak = measured.get("peak_host_bytes") or COMPILE_PEAK_HOST_BYTES
    workers, why = compile_workers(host_bytes or INF2_8XLARGE_HOST, cpus or INF2_8XLARGE_VCPUS, weight_bytes_per_rank, peak)
    if measured.get("minutes_per_graph"):
        per = max(measured["minutes_per_graph"].values())
        source, basis = f"measured on inf2 ({calibration.get('source', 'calibration')})", "measured"
    else:
        per, source, basis = PUBLISHED_MINUTES_PER_GRAPH, PUBLISHED_SOURCE, "published, not measured"
    rounds = sum(-(-int(g) // workers) for g in ([graphs] if isinstance(graphs, int) else graphs))
    return {"minutes": round(rounds * per, 1), "per_graph": per, "workers": workers,
            "workers_reason": why + ("" if measured.get("peak_host_bytes") else " (per-compile memory estimated)"),
            "source": source, "basis": basis}


def refuse_over_budget(command: str, stages: dict[str, int], budget: dict, limit: float | None) -> str | None:
    """The refusal (before any compile) of a run whose cold-compile budget is over `limit` minutes
    (--compile-budget), naming what each build adds; None when within it or no limit was given."""
    if limit is None or budget["minutes"] <= limit:
        return None
    parts = ", ".join(f"{name} {n}" for name, n in stages.items())
    return (f"{command}: a cold compile of {sum(stages.values())} graphs ({parts}) takes about {budget['minutes']:.0f} "
            f"min at {budget['per_graph']:g} min per graph, {budget['workers']} at once ({budget['source']}), over "
            f"--compile-budget {limit:g}. "
            "Drop builds (--batch 1: no batch stage; --skip-served-build), use fewer buckets or KV buckets "
            "(--buckets, --kv-len), restore a compile cache, or raise --compile-budget")


__all__ = ["BATCH_STAGE_SLOTS", "DEVICE_COMMANDS", "PUBLISHED_MINUTES_PER_GRAPH", "PUBLISHED_SOURCE", "compile_minutes",
           "graphs_by_stage", "refuse_over_budget"]
