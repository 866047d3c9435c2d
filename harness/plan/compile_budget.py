"""The cold-compile budget of a device command: which builds it compiles (`graphs_by_stage`: build
name -> compiled graphs), and the minutes those graphs take to compile cold, with the source of the
per-graph figure.

Graphs per build come from the same plan the backends trace (port/device_plan.graph_shapes, the
KV graph plan: each prefill bucket at each KV bucket holding it, decode at every KV bucket, a
verify graph with --speculate) times the batch buckets of a batched build (graphs.batch_buckets),
plus an assistant's draft graphs once (one sequence drafts per call). A model over neuron_cache.PARALLEL_COMPILE_LIMIT_BYTES of
weights per rank compiles one graph at a time (its default compile_workers), so its budget is
graphs x minutes per graph; a smaller one compiles on NxD's pool and its figure is a bound.

Per-graph minutes: this project has not compiled on a device yet, so the figure is published, and
said so: a Llama-3.1-8B decode graph took 21-22 minutes in neuronx-cc in 2025, 5 before a compiler
regression (aws-neuron-sdk issue 1210), and optimum-neuron warns a large model's graph "may take up
to one hour" (aws-neuron-sdk issue 825). Replace it with a measured figure once an inf2 run has
timed one (`MEASURED_MINUTES_PER_GRAPH`).
"""

from __future__ import annotations

from harness.port.device_plan import graph_shapes
from harness.port.graphs import batch_buckets

PUBLISHED_MINUTES_PER_GRAPH = 22.0  # a 8B-class decode graph (aws-neuron-sdk issue 1210); unmeasured here
PUBLISHED_SOURCE = ("published, not measured by this project: 22 min per 8B-class graph "
                    "(aws-neuron-sdk issue 1210; optimum-neuron: up to an hour for large models, issue 825)")
SMALL_MINUTES_PER_GRAPH = 1.0  # a model under the parallel-compile limit (the tiny fixtures): an estimate
SMALL_SOURCE = "estimate for a model under 1 GiB of weights per rank (compiled in parallel), unmeasured"
MEASURED_MINUTES_PER_GRAPH: float | None = None  # set from the first inf2 run's compile log
# The batch stage of a check without --batch: its KV slots (parity/batched.py's MAX_STAGE_SLOTS, the
# most it uses), so the batch buckets 1, 2, 4.
BATCH_STAGE_SLOTS = 4
DEVICE_COMMANDS = ("check", "bisect", "quality", "bench")


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
    if command == "bench":
        return {"perf build": main}
    stages = {"parity build": main}
    if command != "check":
        return stages
    if batch is None:
        stages["batch stage"] = batched(BATCH_STAGE_SLOTS)
    if served:
        stages["served build"] = main
    return stages


def compile_minutes(graphs: int, weight_bytes_per_rank: int) -> dict:
    """{minutes, per_graph, source, basis} of compiling `graphs` graphs cold, one after another above
    the parallel-compile limit; `basis` says in two words whether the per-graph figure was measured."""
    from harness.backends.neuron_cache import PARALLEL_COMPILE_LIMIT_BYTES

    if MEASURED_MINUTES_PER_GRAPH is not None:
        per, source, basis = MEASURED_MINUTES_PER_GRAPH, "measured on inf2", "measured"
    elif weight_bytes_per_rank > PARALLEL_COMPILE_LIMIT_BYTES:
        per, source, basis = PUBLISHED_MINUTES_PER_GRAPH, PUBLISHED_SOURCE, "published, not measured"
    else:
        per, source, basis = SMALL_MINUTES_PER_GRAPH, SMALL_SOURCE, "estimated, not measured"
    return {"minutes": round(graphs * per, 1), "per_graph": per, "source": source, "basis": basis}


def refuse_over_budget(command: str, stages: dict[str, int], budget: dict, limit: float | None) -> str | None:
    """The refusal (before any compile) of a run whose cold-compile budget is over `limit` minutes
    (--compile-budget), naming what each build adds; None when within it or no limit was given."""
    if limit is None or budget["minutes"] <= limit:
        return None
    parts = ", ".join(f"{name} {n}" for name, n in stages.items())
    return (f"{command}: a cold compile of {sum(stages.values())} graphs ({parts}) takes about {budget['minutes']:.0f} "
            f"min at {budget['per_graph']:g} min per graph ({budget['source']}), over --compile-budget {limit:g}. "
            "Drop builds (--batch 1: no batch stage; --skip-served-build), use fewer buckets or KV buckets "
            "(--buckets, --kv-len), restore a compile cache, or raise --compile-budget")


__all__ = ["BATCH_STAGE_SLOTS", "DEVICE_COMMANDS", "PUBLISHED_MINUTES_PER_GRAPH", "compile_minutes",
           "graphs_by_stage", "refuse_over_budget"]
