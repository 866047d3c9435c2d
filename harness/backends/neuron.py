"""Neuron backend: NxD trace/compile/load/run of the per-rank decoder on inf2 (TP=2).

The only module of the project that runs torch_neuronx / neuronx_distributed, and it imports them
inside functions (NxD always through neuron_env.import_neuronx_distributed): `import
harness.backends.neuron` works on any CPU machine, and the pure parts are tested there. The host's
Neuron environment (version guard, cores, platform, the NxD import) is in neuron_env.py; compiler
flags and the artifact cache in neuron_cache.py; both are re-exported here.

What runs on the device is `harness.port.graphs.traced_class(spec)` (the graphs, defined once for this
and the XLA backend): the 12B's `TracedDecoder` over `harness.port.model.RankDecoder`, or for the rest of
the Gemma-4 family `TracedFamilyDecoder` over `harness.port.blocks.FamilyRankDecoder` (per-layer
inputs, KV-shared layers, the MoE block), the same code the CPU backend runs, built with
`NeuronLinears` (NxD's ColumnParallelLinear / RowParallelLinear instead of nn.Linear, NxD's
all-reduce instead of explicit collectives: neuron_layers.py) and traced with ModelBuilder v2 under NxDParallelState: one graph per
(sequence length, KV bucket) of `graphs.kv_graph_plan` (each prefill bucket at every KV bucket that
holds it, decode (s=1) at every KV bucket), tagged `kv_tag(tag, kv)`; each call runs the graph of
its length at the smallest KV bucket holding its positions (`graphs.kv_read_length`). The KV cache buffers, reassigned in forward, become device state
aliased between calls. Per-rank weights come from `harness.port.sharding.rank_state_dicts` and are
loaded with NxDModel.set_weights + to_neuron. A build of --batch N KV slots traces each graph at
every batch bucket (graphs.batch_buckets; tag `..._bsB`) with `seq_ids` as an input (docs/batch.md). Compiled graphs are cached on disk under a key of
everything that changes them (docs/design.md#backends); weights are never part of a cache entry.

NxD APIs used (signatures read in aws-neuron/neuronx-distributed's public source, Release 2.29
(commit fbac349, the newest published; 0.19 / SDK 2.31 has no public source):
ModelBuilder(model).trace(args=, tag=).compile(priority_model_key=, compiler_workdir=,
compiler_args=, max_workers=) -> NxDModel; NxDModel.set_weights(list of rank dicts), .to_neuron(),
.save(path), NxDModel.load(path), .get_metaneff(tag), .write_to_neuron_buffer(tensor, key, rank),
.read_from_neuron_buffer(key, rank) (keys: the raw checkpoint key) and forward(*args,
model_name=tag), .layout_transformer; NxDParallelState(world_size=, tensor_model_parallel_size=, lnc_size=);
parallel_layers.layers.ColumnParallelLinear / RowParallelLinear. tests/nxd_double is a contract
double of exactly this surface: tests/parity/test_neuron_double.py runs this backend through it.
"""

from __future__ import annotations

import json
import os
import shlex  # noqa: F401  (tests reach it as neuron.shlex)
import shutil
import time
from pathlib import Path

import torch

from harness.backends.neuron_cache import (  # noqa: F401  (re-exported: the backend's cache and flags)
    CACHE_FORMAT, DEFAULT_COMPILER_ARGS, ENTRY_FILES, META_FILE, MODEL_FILE, MODEL_SOURCE_FILES,
    artifact_cache_key, cache_entry_complete, compile_environment, compiler_flag_string, decode_flags,
    default_cache_dir, model_source_hash, normalize_compiler_args, per_graph_flags, read_cache_meta,
    write_cache_entry)
from harness.backends.neuron_env import (  # noqa: F401  (re-exported: the host's Neuron environment)
    INF2_CORES_PER_DEVICE, INF2_LNC, assign_visible_cores, build_platform, import_neuronx_distributed,
    neuron_core_count, neuron_runtime_version, visible_cores_for_worker)
from harness.backends.neuron_packages import (  # noqa: F401  (re-exported: the SDK's pinned packages)
    NEURON_SDK_RELEASE, PINNED_VERSIONS, check_neuron_packages, installed_neuron_packages, toolchain_version,
    version_matches)
from harness.backends.neuron_build import (  # noqa: F401  (re-exported: a build's graph tags)
    Built, compile_build, kv_graphs_json, kv_tag, kv_tags)
from harness.backends.neuron_calibration import device_bytes_in_use, record_build
from harness.backends.neuron_gate import admit_build, default_compile_workers
from harness.backends.neuron_drafter import NeuronDrafter, draft_tags, drafter_key, drafter_rank_weights, open_assistant
from harness.base.errors import HarnessInputError
from harness.port.graphs import (  # noqa: F401  (the device graphs, defined once for every backend)
    DECODE_TAG, POSITION_DTYPE, PREFILL_TAG, GraphBuildError, TracedDecoder, batch_buckets, batch_example_inputs,
    batch_graph_inputs, batch_tag, constant_buffers, example_inputs, graph_inputs, graph_plan, graph_result,
    input_width, is_verify_tag, kv_buffer_names, kv_buckets, kv_graph_plan, kv_read_length, tag_for_length, traced_class, unpack_outputs)
from harness.base.settings import RunSettings, directory, flag, positive_int, torch_dtype
from harness.port.sharding import bytes_per_rank, plan_model, rank_state_dicts

# Tracing or compiling a graph failed (not bad input: the compiler or the model code); one error
# type whatever lowers the graph (harness/port/graphs.py).
NeuronBuildError = GraphBuildError

from harness.backends.neuron_layers import (  # noqa: E402,F401  (re-exported: the NxD layers)
    DEFAULT_LAYOUT_PRIORITY, NeuronLinears, NxDCollectives, QuantizedNeuronLinears, quantize_key, quantized, _checkpoint_key,
    _dtype_key, _layout_priority, _module_weight_shapes, _nxd_layers, _priority_key, _weight_shapes_from_json,
    _weight_shapes_to_json, assemble_rank_weights, graph_io)


# ==== the backend ==================================================================================

class NeuronBackend:
    """Runs the port on NeuronCores through NxD at tensor parallel degree `tp` (same interface as
    CpuBackend). Builds (or loads from the artifact cache) the prefill graphs of `buckets` and the
    decode graph; `capture=True` makes a parity build whose forward can also return captures.

    Build options (each part of the cache key): `compiler_args` (shell words or a list), the
    context-encoding (prefill) graphs' flags; `decode_compiler_args`, every other graph's (decode,
    verify, draft; default `compiler_args` at -O2, neuron_cache.decode_flags; same --target);
    `layout_priority`, the graph whose weight layout NxD optimises ("decode", "prefill", or None:
    none, the default until a device run measures the transform's peak, neuron_layers);
    `reduce_dtype`, the row-parallel all-reduce dtype; `compile_workers`, graphs compiled at once
    (default: from this host's memory and vCPUs, neuron_gate.compile_workers; the reason is printed)."""

    name = "neuron"

    # The backend options (harness.backends.Backend): name -> converter of a --backend-option value.
    OPTIONS = {"compiler_args": str, "decode_compiler_args": str, "cache_dir": directory, "compile_workers": positive_int,
               "zero_on_reset": flag, "layout_priority": _layout_priority, "reduce_dtype": torch_dtype}
    reads_cache, host_ranks, serves_batch, drafts_on_device = True, False, True, True

    def __init__(self, checkpoint, settings: RunSettings, capture: bool = False, *, compiler_args=None,
                 cache_dir=None, compile_workers: int | None = None, zero_on_reset: bool = True,
                 layout_priority: str | None = DEFAULT_LAYOUT_PRIORITY, reduce_dtype: torch.dtype = torch.float32,
                 decode_compiler_args=None, assistant=None):
        tp, dtype, max_len, buckets = settings.tp, settings.torch_dtype, settings.kv_len, settings.buckets
        self.sliding_cache, self.quantize = settings.sliding_cache, getattr(settings, "quantize", None)
        self.versions = check_neuron_packages()  # before anything imports the SDK
        self.spec, self.tp, self.dtype, self.max_len = checkpoint.spec, tp, dtype, max_len
        plan_model(self.spec, tp)  # a layout that cannot shard fails here, before any compile
        self.visible_cores = assign_visible_cores(tp)  # a core list smaller than tp fails here, before any build
        self.speculate = settings.speculate
        self.graphs = graph_plan(buckets, max_len, settings.speculate)  # with the verify graph (speculate > 0)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.kv_lengths = kv_buckets(self.buckets, max_len)
        # settings.batch KV slots (NxD Inference's max_batch_size): every graph at each batch bucket
        self.slots, self.batch_sizes = settings.batch, batch_buckets(settings.batch)
        self.kv_graphs = kv_tags(self.buckets, max_len, self.slots, settings.speculate)  # the ModelBuilder tags: (length, KV bucket) each
        # with an assistant, its draft graphs in the same model (neuron_drafter.py): one per KV bucket
        self.assistant = assistant if assistant is not None else open_assistant(settings, self.spec)
        self.draft_graphs = draft_tags(self.kv_lengths) if self.assistant is not None else {}
        self.last_tag: str | None = None  # the tag the last forward ran
        self.capture = self.returns_captures = bool(capture)
        # a perf build returns only what greedy decode needs: the last real row (of each sequence)
        self.last_row_only = not self.capture
        self.compiler_args = normalize_compiler_args(compiler_args)
        self.decode_compiler_args = decode_flags(self.compiler_args, decode_compiler_args)
        self.priority_key = _priority_key(layout_priority, self.kv_graphs)
        self.reduce_dtype = reduce_dtype
        workers = default_compile_workers(bytes_per_rank(self.spec, tp, _dtype_key(dtype), max_len)["weights"])
        self.compile_workers, self.workers_reason = ((compile_workers, "--backend-option compile_workers")
                                                     if compile_workers is not None else workers)
        self.zero_on_reset = zero_on_reset
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_key = artifact_cache_key(
            spec_hash=self.spec.spec_hash(), buckets=self.buckets, tp=tp, compiler_version=toolchain_version(self.versions),
            compiler_args=self.compiler_args, model_source_hash=model_source_hash(), capture=self.capture,
            max_len=max_len, dtype=dtype, sliding_cache=settings.sliding_cache, kv_graphs=self.kv_graphs,
            drafter=drafter_key(self.assistant.spec, settings.speculate, self.draft_graphs) if self.assistant else None,
            environment={**compile_environment(neuron_runtime_version()), "layout_priority": str(self.priority_key),
                         "reduce_dtype": _dtype_key(reduce_dtype), **quantize_key(self.quantize),
                         "graph_flags": self._graph_flags()})  # which graph gets which flags, not only the strings
        self.artifact_dir = self.cache_dir / self.cache_key
        self.compiled, self.timings = False, {}  # compiled: this process compiled the graphs (a cache miss)
        self.build = admit_build(self, self.quantize)  # the one gate, before any trace (neuron_gate.py)

        calibrate, start = os.environ.get("GEMMA_PARITY_CALIBRATE"), time.perf_counter()
        held = device_bytes_in_use(tp) if calibrate else None  # before this build's load (calibration)
        built = self._load_or_compile()
        self.nxd_model, self.capture_names = built.model, built.capture_names
        self.kv_names, self.original_weights = built.kv_names, built.weight_shapes
        self.drafter = NeuronDrafter(self, self.assistant, built.draft_capture_names) if self.assistant else None
        self.timings["build_s" if self.compiled else "load_s"] = time.perf_counter() - start
        self.weight_specs, self.state_specs = self._graph_io()
        start = time.perf_counter()
        self._load_weights(checkpoint)
        self.timings["weights_s"] = time.perf_counter() - start
        if calibrate:  # the device job: what this build cost, for the next plan
            record_build(self, self.timings.get("build_s"), held, device_bytes_in_use(tp))
        self._zeros = {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in self.state_specs.items()
                       if key in self.kv_names}

    # -- building ------------------------------------------------------------------------------------
    def _graph_flags(self) -> str:
        return json.dumps(per_graph_flags({**self.kv_graphs, **self.draft_graphs}, self.compiler_args,
                                          self.decode_compiler_args), sort_keys=True)

    def _load_or_compile(self):
        if self.artifact_dir.exists():
            return self._load_entry()
        return self._compile_entry()

    def _load_entry(self):
        NxDModel = import_neuronx_distributed().NxDModel
        meta = read_cache_meta(self.artifact_dir, self.cache_key)
        if meta.get("graphs") != kv_graphs_json(self.kv_graphs):
            raise HarnessInputError(f"cache entry {self.artifact_dir} holds graphs {meta.get('graphs')}, "
                                    f"not {kv_graphs_json(self.kv_graphs)}; delete it and run again")
        os.utime(self.artifact_dir)  # used by this run: the CI's prune keeps it (.github/inf2-compile-cache.sh)
        model = NxDModel.load(str(self.artifact_dir / MODEL_FILE))
        if not isinstance(model, NxDModel):
            raise HarnessInputError(f"{self.artifact_dir / MODEL_FILE} could not be restored as an NxDModel by "
                                    f"this neuronx-distributed ({self.versions['neuronx-distributed']}); "
                                    f"delete {self.artifact_dir} and run again to recompile")
        return Built(model, meta.get("capture_names") or None, list(meta["kv_buffers"]),
                     _weight_shapes_from_json(meta["weight_shapes"]), meta.get("draft_capture_names"))

    def _compile_entry(self):
        workdir = self.cache_dir / ".work" / f"{self.cache_key}-{os.getpid()}"
        print(f"neuron: compiling {self.build.graphs} graphs cold, {self.workers_reason}", flush=True)
        built: list[Built] = []

        def write(tmp: Path):
            built.append(self._compile(workdir))
            b = built[0]
            b.model.save(str(tmp / MODEL_FILE))
            meta = {"format": CACHE_FORMAT, "key": self.cache_key, "graphs": kv_graphs_json(self.kv_graphs),
                    "capture_names": b.capture_names, "kv_buffers": b.kv_names,
                    "draft_graphs": kv_graphs_json(self.draft_graphs), "draft_capture_names": b.draft_capture_names,
                    "weight_shapes": _weight_shapes_to_json(b.weight_shapes), "last_row_only": self.last_row_only,
                    "compiler_args": self.compiler_args, "decode_compiler_args": self.decode_compiler_args,
                    "versions": self.versions,
                    "layout_priority": self.priority_key, "reduce_dtype": _dtype_key(self.reduce_dtype),
                    "compile_workers": self.compile_workers, "spec_hash": self.spec.spec_hash(), "tp": self.tp,
                    "max_len": self.max_len, "dtype": _dtype_key(self.dtype),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))

        write_cache_entry(self.cache_dir, self.cache_key, write)
        shutil.rmtree(workdir, ignore_errors=True)  # kept only when the compile failed
        self.compiled = True
        return built[0]

    def _compile(self, workdir: Path) -> Built:
        return compile_build(self, workdir)

    def _graph_io(self):
        """Weights and states the graphs read (neuron_layers.graph_io), checked against the module's."""
        return graph_io(self.nxd_model, {**self.kv_graphs, **self.draft_graphs}, self.original_weights, self.kv_names,
                        where=f"delete the cache entry {self.artifact_dir} and run again")

    def _load_weights(self, checkpoint):
        states = rank_state_dicts(checkpoint, self.tp, self.dtype, **quantized(self.quantize))
        if self.assistant is not None:  # the drafter's weights beside the target's (drafter.*)
            states = [{**s, **d} for s, d in zip(states, drafter_rank_weights(self.assistant, self.tp, self.dtype))]
        if not self.weight_specs:
            raise NeuronBuildError(f"the compiled graphs in {self.artifact_dir} name no weights; delete the "
                                   "entry and run again")
        weights = assemble_rank_weights(states, self.weight_specs, where=f"the compiled graphs in {self.artifact_dir}")
        del states
        try:
            self.nxd_model.set_weights(weights)  # with a priority graph: the layout transform, on the device
            self.nxd_model.to_neuron()
        except RuntimeError as exc:  # the runtime's (out of device memory); a contract ValueError passes as is
            hint = ("; the weight-layout transform may hold a second copy of the weights on each core "
                    "(instances.core_bytes): try --backend-option layout_priority=none") if self.priority_key else ""
            raise NeuronBuildError(f"loading the weights onto the NeuronCores failed: {exc!r}{hint}") from exc

    # -- running -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the KV cache on every rank. Costs one host->device copy of the cache per rank; prefill
        never reads stale slots (causal mask), so timing runs may pass zero_on_reset=False."""
        if not self.zero_on_reset:
            return
        for rank in range(self.tp):
            for key, zeros in self._zeros.items():
                self.nxd_model.write_to_neuron_buffer(zeros, key, rank)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False,
                last: int | None = None, seq_ids: torch.Tensor | None = None, verify: bool = False):
        """inputs_embeds [1, s, graphs.input_width] (the hidden size, plus the per-layer rows of a
        model with per-layer inputs), positions [1, s] -> raw logits [1, s, vocab] (with captures
        when asked, on a parity build). s must be a compiled bucket or 1 (decode). A perf build
        returns only row `last` (the last real position; 0 for decode): [1, 1, vocab]. Runs the graph
        of that length at the smallest KV bucket holding the call's positions (`last_tag`). A build of
        several KV slots takes [b, s] rows (b a batch bucket) and `seq_ids` [b] (harness/port/kv_slots.py).
        `verify`: the verify graph (graphs.VERIFY_TAG: every row's logits; graphs.graph_result)."""
        if self.slots > 1:
            if capture and not self.capture:
                raise HarnessInputError("this is a perf build (no capture outputs in its graphs); build the "
                                        "backend with capture=True for a parity build to capture activations")
            args = batch_graph_inputs(self.spec, self.graphs, inputs_embeds, positions, seq_ids=seq_ids,
                                      dtype=self.dtype, slots=self.slots, last_row_only=self.last_row_only,
                                      verify=verify)
            tag = tag_for_length(positions.shape[1], self.graphs, verify)
        else:
            tag, args = graph_inputs(self.spec, self.graphs, inputs_embeds, positions, self.dtype, capture=capture,
                                     parity_build=self.capture, last_row_only=self.last_row_only, last=last,
                                     verify=verify)
        self.last_tag = self._tag_for_call(tag, positions)
        out = self.nxd_model(*args, model_name=self.last_tag)
        embeds = args[0][..., :self.spec.hidden_size]  # the embeddings capture, without per-layer rows
        return graph_result(out, self.capture_names if self.capture else None, embeds, capture,
                            self.last_row_only, last=last, verify=verify)

    def _tag_for_call(self, tag: str, positions: torch.Tensor) -> str:
        """The traced graph of `tag`'s length at the smallest KV bucket that holds the call's
        positions (graphs.kv_read_length) and the graph's own length: a prefill bucket is traced
        only at KV buckets that hold it (graphs.kv_graph_plan), and the slots past the real
        positions it then also reads are masked out (empty, or later positions)."""
        length, needed = self.graphs[tag], kv_read_length(positions, self.kv_lengths)
        kv = min(kv for n, kv in self.kv_graphs.values() if n == length and kv >= needed)
        rows = positions.shape[0]
        if self.slots == 1:
            return kv_tag(tag, kv)
        if rows not in self.batch_sizes:
            raise HarnessInputError(f"{rows} rows in one call: this build has batch buckets {list(self.batch_sizes)}; "
                                    "pad the rows to one (harness.port.engine.Engine.call does)")
        return batch_tag(kv_tag(tag, kv), rows)

    def kv_cache(self, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer's cache on one rank, copied from the device: [slots, kv_heads, max_len, d].
        A KV-shared layer holds none: its source layer's, which it reads (as CpuBackend.kv_cache)."""
        source = self.spec.layers[layer].kv_source if 0 <= layer < self.spec.num_layers else None
        keys = [f"layers.{layer if source is None else source}.self_attn.cache.{b}" for b in ("k", "v")]
        absent = [k for k in keys if k not in self.state_specs]
        if absent:
            raise HarnessInputError(f"no device buffer {absent}; KV buffers are {self.kv_names[:4]} ...")
        k, v = (self.nxd_model.read_from_neuron_buffer(key, rank) for key in keys)
        return k, v
