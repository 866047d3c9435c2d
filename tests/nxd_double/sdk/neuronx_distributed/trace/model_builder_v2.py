"""ModelBuilder (v2) of the double.

Upstream: src/neuronx_distributed/trace/model_builder_v2.py and trace/functions.py (neuronx-distributed
Release 2.29, commit fbac349):
  ModelBuilder(model, weights_to_skip_layout_optimization=None)
  .trace(args=None, kwargs=None, tag=None, spmd=True) -> self
  .compile(priority_model_key=None, compiler_workdir=None, compiler_args=None, max_workers=None) -> NxDModel
Rules enforced as upstream: the traced forward may not take *args/**kwargs and its parameters may
default only to None (_validate_model, _validate_model_params); args is None, a tensor or a tuple
of tensors; every required parameter must be given; the example inputs fix the graph's shapes and
the route is (parameter names, shapes) (nxd_model/utils.py generate_route_key_from_provided_args);
compiler_args is a string for every graph or a dict with a key per tag; an unknown
priority_model_key is a ValueError; the default flags of functions.py append_default_compiler_flags
(empty -> "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"; else
--auto-cast=none and -O1 added when absent; --verbose=35; --logfile in the workdir); the platform
target comes from torch_neuronx.utils.get_platform_target(flags); the compile goes through
libneuronxla.neuron_xla_compile.
State, modelled on the documented ModelBuilder v2 behaviour: a buffer reassigned out of place in
forward becomes aliased device state (same shape and dtype required); an in-place update of a
buffer or parameter is refused, and so is a parameter reassigned in forward (the docs: "not
supported"); every other parameter is a weight the graph reads, keyed by its module path; a buffer
never reassigned is folded into the graph as a constant at its trace-time value (the tracer may do
so; unverified, so the double does), read by no graph.
Weight layout optimisation (a priority_model_key, upstream _compile_priority_model and
functions.py compile_layout_transformer): the priority graph is compiled with the WLO flags, then a
layout transformer is compiled with flags that carry no --target (`--model-type=transformer
--lnc=1 --internal-hlo2tensorizer-options='...' --logfile=... --verbose=35`), so its platform comes
from the host or $NEURON_PLATFORM_TARGET_OVERRIDE; when no weight's layout changes it is None. A graph output that is one of the graph's own inputs is refused (no
upstream example returns an input under aliasing; the double is conservative here).
A trace is the code as it ran then (fixed.py): the module's Python state at trace() (plain tensor
attributes, branches taken on tensor values) is baked into that tag's graph and replayed on every
call; a trace with no input tensor is refused, as upstream, so each tag runs a snapshot of the module taken when it was
traced; changing the module after its trace changes no compiled graph.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import pathlib
import shlex
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import libneuronxla
import torch
import torch_neuronx
from torch_neuronx.proto import metaneff_pb2
from torch_neuronx.xla_impl.trace import dtype_name

from ..parallel_layers import parallel_state
from . import fixed
from .nxd_model import NxDModel, _set as _set_tensor

DEFAULT_COMPILER_WORKDIR = "/tmp/nxd_model/"
DEFAULT_FLAGS = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
WLO_REQUIRED = ("--model-type=transformer", "--enable-internal-neff-wrapper", "--auto-cast=none", "--verbose=35")


@dataclass
class TraceArtifacts:
    model_params: list  # [(name, is_positional)]
    provided: list  # [(name, shape, dtype)] the example inputs, in signature order
    weights: dict  # name -> (shape, dtype), the original (checkpoint) layout
    states: dict  # name -> (shape, dtype)
    outputs: list  # [(shape, dtype)]
    single_output: bool
    metaneff: object = None
    hlo: bytes = b""
    compiler_flags: str = ""
    neff: bytes = b""
    extra: dict = field(default_factory=dict)
    module: object = None  # the module as traced (on meta): the graph's code, Python state baked in

    def route_key(self) -> str:
        return "(" + ", ".join(f"{name}: {list(shape)}" for name, shape, _ in self.provided) + ")"


def _signature_params(model) -> list:
    sig = inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model)
    if not sig.parameters:
        raise ValueError("Model must have at least one parameter")
    params = []
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise NotImplementedError("Methods with *args or **kwargs are not supported. "
                                      "Please explicitly specify all parameters.")
        if name == "self":
            continue
        if p.default is not inspect.Parameter.empty and p.default is not None:
            raise ValueError(f"Parameter '{name}' has a non-None default value: {p.default}. "
                             "Only None is allowed as a default value for parameters.")
        params.append((name, p.default is inspect.Parameter.empty))
    return params


def _provided_inputs(params, args, kwargs) -> OrderedDict:
    if isinstance(args, torch.Tensor):
        args = (args,)
    args = () if args is None else args
    if not isinstance(args, tuple) or not all(isinstance(t, torch.Tensor) for t in args):
        raise ValueError("args must be either None, a single tensor, or a tuple of tensors")
    if len(args) > len(params):
        raise ValueError(f"Too many positional arguments. Model accepts {len(params)} but received {len(args)}")
    provided = OrderedDict((params[i][0], t) for i, t in enumerate(args))
    for key, value in (kwargs or {}).items():
        if key not in dict(params) or key in provided or not isinstance(value, torch.Tensor):
            raise ValueError(f"invalid keyword example input {key!r}")
    provided.update((name, kwargs[name]) for name, _ in params if kwargs and name in kwargs)
    missing = [name for name, required in params if required and name not in provided]
    if missing:
        raise ValueError(f"Missing required parameters: {missing}.")
    if not provided:  # upstream functions.py _process_example_inputs
        raise ValueError("At least one input tensor must be provided via args or kwargs")
    return provided


def _tensors(module) -> dict:
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


def _run_and_find_state(model, inputs: OrderedDict):
    """Run forward once (as rank 0 of a mocked group); return (outputs, states) and leave every
    buffer as it was. Raises on in-place updates and on state that changes shape or dtype."""
    before = {name: (t, t._version) for name, t in _tensors(model).items()}
    parameters = {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        out = model(**inputs)
    after = _tensors(model)
    states, errors = {}, []
    for name, (old, version) in before.items():
        new = after.get(name)
        if new is old:
            if new._version != version:
                errors.append(f"{name} was updated in place (in-place updates are not supported: "
                              "reassign the buffer out of place, e.g. with index_copy)")
            continue
        if name in parameters:
            errors.append(f"parameter {name} was reassigned in forward (not supported: a parameter is a "
                          "weight; state must be a buffer reassigned out of place)")
        elif new is None or tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
            errors.append(f"state {name} changed from {tuple(old.shape)} {old.dtype} to "
                          f"{None if new is None else (tuple(new.shape), new.dtype)}")
        states[name] = (tuple(old.shape), old.dtype)
        _set_tensor(model, name, old)
    if errors:
        raise RuntimeError("HLO generation failed: " + "; ".join(errors))
    return out, states


def _outputs(out, inputs: OrderedDict):
    single = isinstance(out, torch.Tensor)
    items = [out] if single else list(out) if isinstance(out, (tuple, list)) else None
    if items is None or not all(isinstance(t, torch.Tensor) for t in items):
        raise RuntimeError(f"HLO generation failed: outputs must be a tensor or a tuple of tensors, got {type(out)}")
    for i, t in enumerate(items):
        for name, x in inputs.items():
            if t is x or (t.numel() and x.numel() and t.data_ptr() == x.data_ptr()):
                raise RuntimeError(f"HLO generation failed: output {i} is the graph input {name!r} itself; "
                                   "return only values the graph computes (take that one on the host)")
    return [(tuple(t.shape), t.dtype) for t in items], single


def _metaneff(art: TraceArtifacts) -> object:
    Type = metaneff_pb2.MetaTensor.Type
    m = metaneff_pb2.MetaNeff()
    for name, shape, dtype in art.provided:
        m.input_tensors.append(metaneff_pb2.MetaTensor(Type.USER_INPUT, shape, dtype_name(dtype),
                                                       user_input_key=name.encode()))
    for kind, specs in ((Type.INPUT_WEIGHT, art.weights), (Type.INPUT_STATE, art.states)):
        for name, (shape, dtype) in specs.items():
            m.input_tensors.append(metaneff_pb2.MetaTensor(kind, shape, dtype_name(dtype), checkpoint_key=name.encode()))
    for shape, dtype in art.outputs:
        m.output_tensors.append(metaneff_pb2.MetaTensor(Type.OUTPUT, shape, dtype_name(dtype)))
    return m


class ModelBuilder:
    def __init__(self, model, weights_to_skip_layout_optimization=None):
        if not torch_neuronx.__version__.startswith("2"):
            raise AssertionError(f"ModelBuilder requires torch-neuronx>=2.* but found {torch_neuronx.__version__}.")
        self.model = model
        self.weights_to_skip_layout_optimization = weights_to_skip_layout_optimization
        self.trace_artifacts_collection: dict[str, TraceArtifacts] = {}
        self.world_size = parallel_state._STATE.get("world", 1)

    def trace(self, args=None, kwargs=None, tag=None, spmd=True):
        if not spmd:
            raise NotImplementedError("MPMD tracing is not currently supported")
        params = _signature_params(self.model)
        inputs = _provided_inputs(params, args, kwargs)
        before = fixed.plain_attributes(self.model)
        try:
            with fixed.recording() as python_values:  # what the trace's Python read of tensor values
                out, states = _run_and_find_state(self.model, inputs)
            outputs, single = _outputs(out, inputs)
        except RuntimeError:
            raise
        except Exception as exc:
            raise RuntimeError(f"HLO generation failed: {exc}") from exc
        # A buffer forward never reassigns is a value of the code, not an input: the double folds it
        # into the graph at its trace-time value (conservative: the tracer may, unverified), so the
        # graph does not read it and set_weights refuses it. Weights are parameters.
        weights = {n: (tuple(t.shape), t.dtype) for n, t in self.model.named_parameters() if n not in states}
        art = TraceArtifacts(params, [(n, tuple(t.shape), t.dtype) for n, t in inputs.items()], weights,
                             states, outputs, single)
        art.metaneff = _metaneff(art)
        art.module = copy.deepcopy(self.model).to("meta")
        art.extra["constants"] = {n: t.detach().clone() for n, t in self.model.named_buffers() if n not in states}
        art.extra["python_values"] = python_values  # replayed on every call: the branches the trace took
        art.extra["attributes"] = fixed.fixed_attributes(before, fixed.plain_attributes(self.model))
        art.hlo = json.dumps([art.route_key(), sorted(weights), sorted(states), [str(o) for o in outputs]]).encode()
        tag = tag if tag is not None else hashlib.sha256(art.hlo).hexdigest()[:16]
        self.trace_artifacts_collection[tag] = art
        return self

    def compile(self, priority_model_key=None, compiler_workdir=None, compiler_args=None, max_workers=None):
        tags = list(self.trace_artifacts_collection)
        if not tags:
            raise ValueError("No traces available for compilation. Call trace() first.")
        if priority_model_key and priority_model_key not in tags:
            raise ValueError(f"Invalid priority_model_key: {priority_model_key}")
        if isinstance(compiler_args, dict):
            missing = set(tags) - set(compiler_args)
            if missing:
                raise ValueError(f"Missing compiler args for buckets: {missing}")
        elif isinstance(compiler_args, str) or compiler_args is None:
            compiler_args = {tag: compiler_args for tag in tags}
        try:
            transformer = None
            if priority_model_key:
                self._compile_one(priority_model_key, compiler_args[priority_model_key], compiler_workdir, True)
                transformer = self._compile_layout_transformer(priority_model_key, compiler_workdir)
            for tag in tags:
                if tag != priority_model_key:
                    self._compile_one(tag, compiler_args[tag], compiler_workdir, False)
        except Exception as exc:
            raise RuntimeError("Compilation process failed") from exc
        model = NxDModel(world_size=self.world_size, layout_transformer=transformer)
        for tag in tags:  # each graph's code as traced; weights come from set_weights
            art = self.trace_artifacts_collection[tag]
            model.add(tag, art, art.module)
        return model

    def _compile_one(self, tag, flags, workdir, priority: bool) -> None:
        art = self.trace_artifacts_collection[tag]
        out_dir = os.path.join(workdir or DEFAULT_COMPILER_WORKDIR, tag, time.strftime("%Y-%m-%dT%H-%M-%S"))
        os.makedirs(out_dir, exist_ok=True)
        logfile = f"--logfile={os.path.join(out_dir, 'log-neuron-cc.txt')}"
        if priority:  # functions.py _update_compiler_args_for_compile_wlo: no -O default here
            words = shlex.split(flags or "")
            words += [w for w in WLO_REQUIRED if w not in words]
            flags = shlex.join(words + ([] if any(w.startswith("--logfile") for w in words) else [logfile]))
        else:
            flags = _with_default_flags(flags)
            flags += "" if "--logfile" in flags else f" {logfile}"
        target = torch_neuronx.utils.get_platform_target(flags)
        art.neff = libneuronxla.neuron_xla_compile(
            module_bytes=art.hlo, compiler_flags=flags, input_format="hlo", platform_target=target,
            cache_key=None, retry_failed_compilation=False, lazy=True, use_cache=False, cache_dir=None,
            work_dir=pathlib.Path(out_dir).absolute())
        art.compiler_flags = flags


    def _compile_layout_transformer(self, key, workdir):
        """None when no weight of the priority graph changes layout (upstream: no wrapped NEFF stub);
        else the compiled transformer, recording which weights it re-lays out."""
        art = self.trace_artifacts_collection[key]
        skip = set(self.weights_to_skip_layout_optimization or ())
        changed = sorted(n for n, (shape, _) in art.weights.items() if len(shape) >= 2 and n not in skip)
        if not changed:
            return None
        out_dir = os.path.join(workdir or DEFAULT_COMPILER_WORKDIR, "layout_opt", time.strftime("%Y-%m-%dT%H-%M-%S"))
        os.makedirs(out_dir, exist_ok=True)
        flags = ("--model-type=transformer --lnc=1 --internal-hlo2tensorizer-options='--experimental-unsafe-"
                 f"fp8e4m3fn-as-fp8e4m3 --verify-hlo=true' --logfile={os.path.join(out_dir, 'log-neuron-cc.txt')} "
                 "--verbose=35")
        target = torch_neuronx.utils.get_platform_target(flags)  # no --target: the host's, or the override
        neff = libneuronxla.neuron_xla_compile(
            module_bytes=json.dumps(changed).encode(), compiler_flags=flags, input_format="hlo", platform_target=target,
            cache_key=None, retry_failed_compilation=False, lazy=True, use_cache=False, cache_dir=None,
            work_dir=pathlib.Path(out_dir).absolute())
        return {"weights": changed, "neff": neff, "target": target}


def _with_default_flags(flags) -> str:
    import re

    flags = flags or DEFAULT_FLAGS
    if "--auto-cast" not in flags:
        flags += " --auto-cast=none "
    if not re.search(r"-O\d+", flags):
        flags += " -O1 "
    if "--verbose" not in flags:
        flags += " --verbose=35"
    return flags
