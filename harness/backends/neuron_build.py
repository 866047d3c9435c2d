"""A Neuron build's graphs: their ModelBuilder tags (`kv_tag`, `kv_tags`: each (length, KV bucket) of
graphs.kv_graph_plan, at every batch bucket of a build of several KV slots), the module NxD traces
(the spec's traced decoder with NxD's layers, neuron_layers.py), the trace and compile of every graph
(`compile_build`) and what a build or a cache entry provides (`Built`). The backend
(harness/backends/neuron.py) decides when to compile, loads and runs; this module only builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from harness.backends.neuron_cache import compiler_flag_string, per_graph_flags
from harness.backends.neuron_drafter import trace_draft_graphs
from harness.backends.neuron_env import INF2_LNC, build_platform, import_neuronx_distributed
from harness.backends.neuron_layers import NeuronLinears, QuantizedNeuronLinears, _module_weight_shapes, graph_io
from harness.base.errors import HarnessInputError
from harness.port.draft_graphs import drafting_class
from harness.port.graphs import (GraphBuildError, TracedDecoder, batch_buckets, batch_example_inputs, batch_tag,
                                 constant_buffers, example_inputs, input_width, is_verify_tag, kv_buffer_names,
                                 kv_graph_plan, traced_class)


class Built(NamedTuple):
    """What a build (or a cache entry) provides: the NxDModel and what the graphs were made from."""

    model: object
    capture_names: list[str] | None
    kv_names: list[str]
    weight_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    draft_capture_names: list[str] | None = None  # a fused parity build's draft graphs' (neuron_drafter.py)


def kv_tag(tag: str, kv: int) -> str:
    """The ModelBuilder tag of graph `tag` (graphs.graph_plan) reading KV bucket `kv`."""
    return f"{tag}_kv{int(kv)}"


def kv_tags(buckets, max_len: int, slots: int = 1, speculate: int = 0) -> dict[str, tuple[int, int]]:
    """ModelBuilder tag -> (sequence length, KV bucket), one per graph of graphs.kv_graph_plan (the
    verify graph too, with `speculate` > 0); with several KV `slots`, each of them at every batch
    bucket (graphs.batch_buckets, graphs.batch_tag)."""
    plan = {kv_tag(tag, kv): (length, kv) for tag, length, kv in kv_graph_plan(buckets, max_len, speculate)}
    return plan if slots == 1 else {batch_tag(t, b): v for t, v in plan.items() for b in batch_buckets(slots)}


def kv_graphs_json(kv_graphs: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    return {tag: [int(length), int(kv)] for tag, (length, kv) in sorted(kv_graphs.items())}


def traced_module(be) -> TracedDecoder:
    """The traced module of backend `be`'s spec (the 12B's or the family's), with NxD's layers."""
    fused = {"assistant": be.assistant.spec} if be.assistant is not None else {}
    linears = (QuantizedNeuronLinears if be.quantize else NeuronLinears)(be.tp, be.dtype, be.reduce_dtype)
    module = (drafting_class if fused else traced_class)(be.spec, batched=be.slots > 1)(
        be.spec, be.tp, be.max_len, be.dtype, linears, with_captures=be.capture, last_row_only=be.last_row_only,
        sliding_cache=be.sliding_cache, slots=be.slots, **fused)
    module.eval()
    module.requires_grad_(False)
    extra = sorted(constant_buffers(module))
    if extra:  # values from the model code would have to reach the device by NxD naming rules
        raise GraphBuildError(f"the traced module holds buffers {extra[:8]} that are neither checkpoint "
                              "weights nor KV cache; compute such values in the graph from constants")
    return module


def trace_inputs(be, tag: str, length: int) -> tuple:
    """The example inputs graph `tag` of `length` positions is traced with in backend `be`'s build (a
    perf build's last_index, except on a verify graph, which returns every row)."""
    width, last_row = input_width(be.spec), be.last_row_only and not is_verify_tag(tag)
    if be.slots == 1:
        return example_inputs(length, width, be.dtype, last_row=last_row)
    return batch_example_inputs(length, width, be.dtype, int(tag.rsplit("_bs", 1)[1]), last_row=last_row)


def compile_build(be, workdir: Path) -> Built:
    """Trace every graph of backend `be`'s plan with ModelBuilder v2 and compile them -> Built. The
    priority graph (none by default) gets the weight layout optimised for it; the others use it."""
    nxd = import_neuronx_distributed()
    flags = compiler_flag_string(be.compiler_args)
    graphs = {**be.kv_graphs, **be.draft_graphs}
    per_graph = per_graph_flags(graphs, be.compiler_args, be.decode_compiler_args)
    try:
        # lnc_size=1: inf2's NeuronCore-v2 has one physical core per logical core. NxD still asks
        # the platform in initialize_model_parallel and for the layout transformer's compile:
        # build_platform names it (the flags' --target) on a build host without a device.
        with build_platform(be.compiler_args), \
                nxd.NxDParallelState(world_size=be.tp, tensor_model_parallel_size=be.tp, lnc_size=INF2_LNC):
            module = traced_module(be)
            kv_names = kv_buffer_names(module)
            weight_shapes = _module_weight_shapes(module, kv_names)  # the checkpoint layout
            builder = nxd.ModelBuilder(module)
            with torch.no_grad():
                for tag, (length, kv) in be.kv_graphs.items():
                    module.set_kv_read(kv)  # the trace bakes in which slots the graph reads
                    builder.trace(args=trace_inputs(be, tag, length), tag=tag)
                module.set_kv_read(None)
                trace_draft_graphs(builder, module, be.draft_graphs, be.spec.hidden_size, be.dtype, batched=be.slots > 1)
            model = builder.compile(priority_model_key=be.priority_key, compiler_workdir=str(workdir),
                                    compiler_args=per_graph, max_workers=be.compile_workers)
    except HarnessInputError:
        raise
    except Exception as exc:
        raise GraphBuildError(
            f"building the neuron graphs {sorted(be.kv_graphs)} failed: {exc!r}"
            + (f" (caused by {exc.__cause__!r})" if exc.__cause__ else "")
            + f". neuronx-cc {be.versions['neuronx-cc']}, flags {flags!r}. The compiler's logs are under "
            f"{workdir} (log-neuron-cc.txt per graph); nothing was written to the artifact cache. A compiler "
            "crash (NCC_* code) on this pinned toolchain is a bug to report with those logs."
        ) from exc
    names = list(module.capture_names) if be.capture else None
    if be.capture and not names:
        raise GraphBuildError("the parity build traced no capture points")
    # before the entry is written: graphs whose state is not exactly the KV cache never reach the cache
    graph_io(model, graphs, weight_shapes, kv_names,
             where="nothing was written to the artifact cache (the model code's bug, not the input's)")
    return Built(model, names, kv_names, weight_shapes,
                 list(module.draft_capture_names) if be.draft_graphs and be.capture else None)


__all__ = ["Built", "compile_build", "kv_graphs_json", "kv_tag", "kv_tags", "trace_inputs", "traced_module"]
