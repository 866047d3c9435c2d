"""NxDModel of the double: the compiled graphs, loaded per rank, executed eagerly on CPU.

Upstream: src/neuronx_distributed/trace/nxd_model/nxd_model.py and base_nxd_model.py
(neuronx-distributed Release 2.29). Methods and rules as upstream:
  NxDModel(world_size, start_rank=None, local_ranks_size=None, state_initializer=None, layout_transformer=None)
  .add(key, trace_artifacts, compilation_artifacts) - graphs must share one forward signature
  .get_metaneff(key) - KeyError for an unknown key
  .set_weights(sharded_checkpoint: List[Dict[str, Tensor]]) - ValueError once loaded on neuron
  .to_neuron() - states created zero-filled (StateInitializer), keyed by the raw checkpoint key
  .read_from_neuron_buffer(buffer_key, rank) / .write_to_neuron_buffer(tensor, buffer_key, rank)
      - AssertionError before to_neuron; KeyError for an unknown key or a shape mismatch
  .forward(*args, model_name=None, forward_mode='default', **kwargs) - routed by
      "(name: [shape], ...)"; model_name must agree with the route; returns rank 0's outputs
  .save(path_to_save, save_weights=False), NxDModel.load(path_to_model, start_rank=None, local_ranks_size=None)
Stricter than the runtime where the runtime would misbehave silently: set_weights needs exactly one
dict per rank holding exactly the weights the graphs read, in the traced (checkpoint) shapes and
dtypes; inputs must have the traced dtypes. With a priority model (weight layout optimisation) the
graphs' metaneff reports the weights the layout transformer re-lays out (2-D+ weights) in a
compiler-chosen layout (modelled as the last two dims swapped) while set_weights still takes
checkpoint shapes (the layout transformer converts them); with no transformer (None: no priority
model, or no layout changed) the metaneff shapes are the checkpoint's.
All graphs share one state (upstream's StateInitializer is made from the first graph added that has
states, and add() checks no later graph against it): a graph with other state shapes, or a state the
first graph lacks, is refused in add(); a graph holding only some of the states is accepted, as
upstream, and reads only those (a buffer it never reassigned stays the constant its trace folded). Execution replays the one SPMD trace on every rank: each rank runs the traced code with the Python
rank reporting 0 (parallel_state.get_tensor_model_parallel_rank), its own weights and states, and
real collectives with the other ranks. Each graph runs its own module as traced (its Python state
baked in), all of a rank's graphs sharing that rank's weights and states.
"""

from __future__ import annotations

import copy
import os
import threading

import torch
from torch_neuronx.proto import metaneff_pb2
from torch_neuronx.xla_impl.trace import dtype_name

from harness.backends.cpu import ThreadGroup

from ..parallel_layers import parallel_state
from . import fixed


# The device's resources as the double models them. A NeuronCore-v2 has 16 GiB of HBM (half an
# Inferentia2 chip's 32); $NXD_DOUBLE_CORE_BYTES sets another for a test. A graph's binary is charged
# NEFF_BYTES (aws-neuron-sdk issue 1210 reports 40 MB for an ArgMax-free graph's NEFF) and the runtime
# RUNTIME_RESERVE_BYTES of its own (scratch, DMA rings: not published; the plan's estimate).
NEFF_BYTES = 64 << 20
RUNTIME_RESERVE_BYTES = 1 << 30


def core_bytes() -> int:
    return int(os.environ.get("NXD_DOUBLE_CORE_BYTES", 16 << 30))


# The Neuron driver's per-core memory counters, as the Neuron sysfs user guide lays them out: with
# $NXD_DOUBLE_SYSFS a directory, each load adds its bytes to <root>/neuron{D}/neuron_core{C}/stats/
# memory_usage/device_mem/<category>/{total,present,peak} (total: in use now), two cores a device (inf2),
# for the cores NEURON_RT_VISIBLE_CORES names, rank r on its r-th core.
DRIVER_CATEGORIES = {"constants": ("weights",), "tensors": ("states", "io"), "model_code": ("binaries",),
                     "runtime_memory": ("reserve",)}


def _visible_cores(world_size: int) -> list[int]:
    cores = []
    for part in filter(None, os.environ.get("NEURON_RT_VISIBLE_CORES", "").split(",")):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return (cores or list(range(world_size)))[:world_size]


def count_on_driver(used: dict, world_size: int) -> None:
    from pathlib import Path

    root = os.environ.get("NXD_DOUBLE_SYSFS")
    if not root:
        return
    for core in _visible_cores(world_size):
        for device in range(core // 2 + 1):
            (Path(root) / f"neuron{device}").mkdir(parents=True, exist_ok=True)
            (Path(root) / f"neuron{device}" / "core_count").write_text("2\n")
        for category, parts in DRIVER_CATEGORIES.items():
            counter = Path(root) / f"neuron{core // 2}" / f"neuron_core{core % 2}" / "stats" / "memory_usage" / "device_mem" / category
            counter.mkdir(parents=True, exist_ok=True)
            added = sum(used[p] for p in parts)
            total = added + (int((counter / "total").read_text()) if (counter / "total").is_file() else 0)
            peak = max(total, int((counter / "peak").read_text()) if (counter / "peak").is_file() else 0)
            for name, value in (("total", total), ("present", added), ("peak", peak)):
                (counter / name).write_text(f"{value}\n")


def _get(module, name):
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    return getattr(mod, attr)


def _set(module, name, tensor):
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    if attr in mod._parameters:
        mod._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        mod._buffers[attr] = tensor


class NxDModel(torch.nn.Module):
    def __init__(self, world_size, start_rank=None, local_ranks_size=None, state_initializer=None,
                 layout_transformer=None):
        super().__init__()
        if start_rank is not None or local_ranks_size not in (None, world_size):
            raise NotImplementedError("the NxD double runs all ranks in one process")
        self.world_size = world_size
        self.layout_transformer = layout_transformer
        self.graphs: dict = {}
        self.input_shape_map: dict[str, list[str]] = {}
        self.model_params: list = []
        self.traced_modules: dict = {}  # tag -> the module as traced (meta)
        self.weights: list[dict] = [{} for _ in range(world_size)]
        self.states: list[dict] = [{} for _ in range(world_size)]
        self.loaded_on_neuron = False
        self.device_memory: dict = {}  # one core's bytes after to_neuron (_load_bytes)
        self._weights_set = False
        self._ranks: list = []

    def add(self, key, trace_artifacts, module):
        if self.model_params and self.model_params != trace_artifacts.model_params:
            raise AssertionError("The model provided appears to have a different signature than all other "
                                 "models added prior.")
        shared = self._state_specs()
        if shared and any(shared.get(k) != v for k, v in trace_artifacts.states.items()):
            first = next(k for k, a in self.graphs.items() if a.states)  # upstream: one StateInitializer
            raise ValueError(f"graph {key!r} holds states {trace_artifacts.states}, graph {first!r} "
                             f"{self._state_specs()}: every graph runs on the one state the first graph's "
                             "metaneff initialises; trace every graph with the same state shapes")
        self.model_params = trace_artifacts.model_params
        self.graphs[key] = trace_artifacts
        self.traced_modules[key] = module
        self.input_shape_map.setdefault(trace_artifacts.route_key(), []).append(key)
        return self

    # -- introspection -------------------------------------------------------------------------
    def get_metaneff(self, key: str):
        if key not in self.graphs:
            raise KeyError(f"key={key!r} not found.")
        meta = self.graphs[key].metaneff
        if not self.layout_transformer:
            return meta
        laid_out = copy.deepcopy(meta)
        changed = set(self.layout_transformer["weights"])
        for t in laid_out.input_tensors:
            if t.type == metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT and t.checkpoint_key.decode() in changed:
                t.shape = t.shape[:-2] + [t.shape[-1], t.shape[-2]]
        return laid_out

    def _weight_specs(self) -> dict:
        specs = {}
        for art in self.graphs.values():
            specs.update(art.weights)
        return specs

    def _state_specs(self) -> dict:
        # upstream add(): the StateInitializer is made from the first graph whose metaneff has states
        return next((art.states for art in self.graphs.values() if art.states), {})

    # -- loading -------------------------------------------------------------------------------
    def set_weights(self, sharded_checkpoint):
        if self.loaded_on_neuron:
            raise ValueError("set_weights() was called when the model was already loaded on neuron. If you "
                             "need to replace your weights, call `replace_weights()` instead.")
        if not isinstance(sharded_checkpoint, list) or len(sharded_checkpoint) != self.world_size:
            raise ValueError(f"set_weights takes a list of {self.world_size} per-rank dicts, got "
                             f"{type(sharded_checkpoint).__name__} of {len(sharded_checkpoint)}")
        expected = self._weight_specs()
        for rank, weights in enumerate(sharded_checkpoint):
            missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
            wrong = [f"{k} {tuple(weights[k].shape)} {weights[k].dtype} (graph reads {expected[k][0]} {expected[k][1]})"
                     for k in sorted(set(expected) & set(weights))
                     if (tuple(weights[k].shape), weights[k].dtype) != (tuple(expected[k][0]), expected[k][1])]
            if missing or extra or wrong:
                raise ValueError(f"rank {rank}: weights do not match the graphs: missing {missing[:6]}, not read "
                                 f"by any graph {extra[:6]}, wrong shape/dtype {wrong[:6]}")
        if self.layout_transformer:  # both layouts on the core while the transformer runs, beside the graphs' binaries and the runtime
            need = (2 * sum(t.numel() * t.element_size() for t in sharded_checkpoint[0].values())
                    + len(self.graphs) * NEFF_BYTES + RUNTIME_RESERVE_BYTES)
            if need > core_bytes():
                raise RuntimeError(f"NRT: out of device memory: the layout transformation needs {need} bytes "
                                   f"on a core of {core_bytes()}")
        self.weights = [{k: v.detach().clone().contiguous() for k, v in w.items()} for w in sharded_checkpoint]
        self._weights_set = True

    def to_neuron(self):
        if self.loaded_on_neuron:
            return
        if not self._weights_set:
            raise RuntimeError("to_neuron() before set_weights(): the graphs have no weights to load")
        states = self._state_specs()
        self.device_memory = self._load_bytes(states)  # what each core holds once loaded, or the load fails
        count_on_driver(self.device_memory, self.world_size)  # the driver's counters see the load
        self.states = [{k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in states.items()}
                       for _ in range(self.world_size)]
        self._ranks = [{tag: self._rank_module(rank, module, self.graphs[tag]) for tag, module in self.traced_modules.items()}
                       for rank in range(self.world_size)]
        self.loaded_on_neuron = True

    def _load_bytes(self, states: dict) -> dict:
        """One core's device memory after the load, as the runtime allocates it: the rank's weights
        as given (their dtype: int8 codes stay int8), every state buffer, each graph's input and
        output buffers and its binary, and the runtime's own reserve; over the core's HBM the load
        fails as the runtime's does (out of device memory)."""
        def nbytes(shape, dtype):
            return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        weights = max(sum(t.numel() * t.element_size() for t in w.values()) for w in self.weights)
        io = {tag: sum(nbytes(shape, dtype) for _, shape, dtype in art.provided) +
              sum(nbytes(shape, dtype) for shape, dtype in art.outputs) for tag, art in self.graphs.items()}
        used = {"weights": weights, "states": sum(nbytes(*spec) for spec in states.values()),
                "io": sum(io.values()), "binaries": len(self.graphs) * NEFF_BYTES, "reserve": RUNTIME_RESERVE_BYTES,
                "graphs": len(self.graphs), "io_by_graph": io}
        used["total"] = sum(used[k] for k in ("weights", "states", "io", "binaries", "reserve"))
        used["core"] = core_bytes()
        if used["total"] > used["core"]:
            raise RuntimeError(f"NRT: out of device memory: loading {len(self.graphs)} graphs needs {used['total']} "
                               f"bytes on a core of {used['core']} (weights {weights}, states {used['states']}, graph "
                               f"I/O {used['io']}, binaries {used['binaries']}, runtime {RUNTIME_RESERVE_BYTES})")
        return used

    def _rank_module(self, rank, traced, art):
        """The graph's code on one rank: its folded constants, the rank's weights, and the states its
        metaneff names (only those: a graph reads no state it does not hold)."""
        module = copy.deepcopy(traced).to_empty(device="cpu")
        states = [(name, t) for name, t in self.states[rank].items() if name in art.states]
        for name, tensor in [*art.extra.get("constants", {}).items(), *self.weights[rank].items(), *states]:
            _set(module, name, tensor)
        return module.eval()

    def replace_weights(self, sharded_checkpoint):
        self.loaded_on_neuron = False
        self.set_weights(sharded_checkpoint)
        self.to_neuron()

    def read_from_neuron_buffer(self, buffer_key: str, rank: int) -> torch.Tensor:
        assert self.loaded_on_neuron, "Model must be loaded on neuron before calling these methods"
        for buffers in (self.states, self.weights):
            if len(buffers) > rank and buffer_key in buffers[rank]:
                return buffers[rank][buffer_key].clone()
        raise KeyError("Could not find neuron buffer: " + buffer_key + " in rank " + str(rank))

    def write_to_neuron_buffer(self, tensor: torch.Tensor, buffer_key: str, rank: int):
        assert self.loaded_on_neuron, "Model must be loaded on neuron before calling these methods"
        buffers = self.states if buffer_key in self.states[rank] else self.weights
        if buffer_key not in buffers[rank]:
            raise KeyError("Could not find neuron buffer: " + buffer_key + " in rank " + str(rank))
        if tensor.shape != buffers[rank][buffer_key].shape:
            raise KeyError(f"Cannot write tensor of shape {tensor.shape} to neuron buffer with shape "
                           f"{buffers[rank][buffer_key].shape}")
        buffers[rank][buffer_key].copy_(tensor)

    # -- running -------------------------------------------------------------------------------
    def _route(self, args, kwargs, model_name):
        names = [name for name, _ in self.model_params]
        inputs = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names or key in inputs:
                raise AssertionError(f"Not all kwargs were parsed: {key!r}")
            inputs[key] = value
        ordered = [(n, inputs[n]) for n in names if n in inputs]
        route = "(" + ", ".join(f"{n}: {list(t.shape)}" for n, t in ordered) + ")"
        model_names = self.input_shape_map[route]  # KeyError: no graph was traced with these shapes
        if len(model_names) > 1:
            assert model_name is not None, "The Model Name must be provided if input routing is ambiguous."
            assert model_name in model_names, (  # the double's rule: a name the shapes cannot reach
                f"Provided model_name does not match the model names found by the shape router: {model_names} "
                f"but got {model_name}")
        else:
            assert model_name is None or model_name == model_names[0], (
                f"Provided model_name does not match model name found by the shape router. Found "
                f"{model_names[0]} but got {model_name}")
            model_name = model_names[0]
        art = self.graphs[model_name]
        for (name, tensor), (_, _, dtype) in zip(ordered, art.provided):
            if tensor.dtype != dtype:
                raise RuntimeError(f"input {name} is {tensor.dtype}; graph {model_name} was traced with {dtype}")
        return model_name, dict(ordered)

    def forward(self, *args, model_name=None, forward_mode="default", **kwargs):
        if not self.loaded_on_neuron:
            raise RuntimeError("Model not initialized. Call set_weights() followed by to_neuron()")
        if forward_mode != "default":
            raise NotImplementedError(f"forward_mode={forward_mode!r}: the double models 'default' only")
        model_name, inputs = self._route(args, kwargs, model_name)
        art = self.graphs[model_name]
        outs = _on_ranks(self.world_size, lambda rank: self._run_rank(rank, model_name, inputs))
        items = outs[0]
        got = [(tuple(t.shape), t.dtype) for t in items]
        if got != art.outputs:
            raise RuntimeError(f"graph {model_name} produced {got}, not its traced outputs {art.outputs}")
        return items[0] if art.single_output else tuple(items)

    def _run_rank(self, rank, model_name, inputs):
        art, module = self.graphs[model_name], self._ranks[rank][model_name]
        fixed.restore_attributes(module, art.extra.get("attributes", {}))  # constants of the trace
        with torch.no_grad(), fixed.replaying(art.extra.get("python_values", ())):
            out = module(**{k: v.clone() for k, v in inputs.items()})
        for name in art.states:
            new = _get(module, name)
            self.states[rank][name].copy_(new)  # aliased: the output lands in the state buffer
            _set(module, name, self.states[rank][name])  # every graph of the rank reads this buffer
        items = [out] if art.single_output else list(out)
        return [t.detach().clone() for t in items]

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path_to_save: str, save_weights: bool = False):
        payload = {"format": "nxd-double-1", "world_size": self.world_size,
                   "layout_transformer": self.layout_transformer,
                   "graphs": self.graphs, "weights": self.weights if save_weights else None}
        torch.save(payload, path_to_save)

    @classmethod
    def load(cls, path_to_model: str, start_rank=None, local_ranks_size=None):
        payload = torch.load(path_to_model, weights_only=False)
        if not isinstance(payload, dict) or payload.get("format") != "nxd-double-1":
            raise ValueError("The Torchscript Model Supplied was not produced with the NxDModel.save method.")
        model = cls(payload["world_size"], start_rank, local_ranks_size, layout_transformer=payload["layout_transformer"])
        for key, art in payload["graphs"].items():
            model.add(key, art, art.module)
        return model


def _on_ranks(world_size, step):
    """step(rank) on one thread per rank, each with its own RankGroup; the first error is raised."""
    threads_group = ThreadGroup(world_size)
    results, errors = [None] * world_size, []

    def run(rank):
        parallel_state._RUNTIME.group = parallel_state.RankGroup(threads_group, rank)
        try:
            results[rank] = step(rank)
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)
            threads_group.barrier.abort()
        finally:
            del parallel_state._RUNTIME.group

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results


__all__ = ["NxDModel", "dtype_name"]
