"""The NxD side of the traced module: NeuronLinears (NxD's column/row-parallel layers in place of
the CPU backend's linears, NxD's collectives in place of its explicit ones), the per-rank weight
dicts NxDModel.set_weights takes, and the weight-layout priority option. Imported by harness/backends/neuron.py only; NxD itself is
imported inside functions (through neuron_env.import_neuronx_distributed), so this module imports
on any CPU machine."""

from __future__ import annotations


import torch
from torch import nn

from harness.backends.neuron_env import import_neuronx_distributed
from harness.base.errors import HarnessInputError
from harness.port.graphs import GraphBuildError
from harness.port.model import Collectives, RankLinears
from harness.port.quantized import QuantizedProjections, quantized  # noqa: F401 (neuron.py's)

# ==== the NxD layers of the traced module (harness/port/graphs.py defines the module) ====================

def _nxd_layers():
    """neuronx_distributed.parallel_layers.layers, imported through import_neuronx_distributed."""
    import_neuronx_distributed()
    from neuronx_distributed.parallel_layers import layers

    return layers


def _nxd_mappings():
    """neuronx_distributed.parallel_layers.mappings, imported through import_neuronx_distributed."""
    import_neuronx_distributed()
    from neuronx_distributed.parallel_layers import mappings

    return mappings


class NxDCollectives(Collectives):
    """The collectives model code asks for outside a parallel layer (the MoE experts' all-reduce,
    harness/port/blocks.py), as NxD's own ops over the tensor-parallel group: the all-reduce is
    reduce_from_tensor_model_parallel_region, the op RowParallelLinear reduces with (its partial
    sums cast to `reduce_dtype` first, as that layer does), so it lowers to the same device
    collective; the all-gather is gather_from_tensor_model_parallel_region_with_dim (names from
    neuronx-distributed's parallel_layers/mappings.py, Release 2.29)."""

    def __init__(self, reduce_dtype: torch.dtype = torch.float32):
        self.reduce_dtype = reduce_dtype

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _nxd_mappings().reduce_from_tensor_model_parallel_region(x.to(self.reduce_dtype)).to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _nxd_mappings().gather_from_tensor_model_parallel_region_with_dim(x, dim % x.dim())


class NeuronLinears(RankLinears):
    """Projections as NxD parallel layers. Sizes passed in are per rank (as RankDecoder asks);
    NxD layers take the full size and divide by the TP degree themselves. `reduce_dtype`: the dtype
    the row-parallel partial sums are all-reduced in (fp32, as the CPU backend does; NxD-Inference's
    models reduce in the model dtype); the same for the collectives model code runs itself.

    Weights outside the parallel layers (norms, the router, the per-layer input's projections, a
    replicated KV head, the MoE experts' per-rank slices) are plain per-rank tensors: the module
    holds one rank's shape, and NxDModel.set_weights takes each rank's own values, assembled from
    harness.port.sharding's shards like every other weight (assemble_rank_weights)."""

    def __init__(self, tp: int, dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32):
        super().__init__(NxDCollectives(reduce_dtype))
        self.tp, self.dtype, self.reduce_dtype = tp, dtype, reduce_dtype

    def column(self, in_features: int, out_per_rank: int) -> nn.Module:
        return _nxd_layers().ColumnParallelLinear(in_features, out_per_rank * self.tp, bias=False,
                                                  gather_output=False, dtype=self.dtype)

    def row(self, in_per_rank: int, out_features: int) -> nn.Module:
        return _nxd_layers().RowParallelLinear(in_per_rank * self.tp, out_features, bias=False, input_is_parallel=True,
                                               dtype=self.dtype, reduce_dtype=self.reduce_dtype)

    def vocab(self, in_features: int, vocab_per_rank: int) -> nn.Module:
        # Each rank's vocabulary slice, all-gathered on the last dim in rank order.
        return _nxd_layers().ColumnParallelLinear(in_features, vocab_per_rank * self.tp, bias=False,
                                                  gather_output=True, dtype=self.dtype)

    def replicated(self, in_features: int, out_features: int) -> nn.Module:
        # A replicated KV head: a plain per-rank Linear, each rank gets the whole head's weight.
        return nn.Linear(in_features, out_features, bias=False, dtype=self.dtype)


class QuantizedNeuronLinears(QuantizedProjections, NeuronLinears):
    """`--quantize int8` on the device: each projection holds its rank's int8 weight and fp32
    scales as plain per-rank tensors (set_weights takes each rank's own, sharded by
    harness.port.sharding with the rows) and dequantizes them to the activation dtype before the
    matmul (harness/port/quantized.py); a row-parallel projection's partial sums are reduced by
    NxD's collective, in `reduce_dtype`, as RowParallelLinear reduces. The lm_head stays NxD's
    full-precision vocabulary-parallel layer (the scheme keeps it)."""


def quantize_key(quantize: str | None) -> dict:
    """What a quantized build adds to its compile-cache key: the scheme's name and description and
    the source of the scheme and its layers (nothing for an unquantized build: its keys unchanged)."""
    if quantize is None:
        return {}
    import hashlib
    from pathlib import Path

    import harness.inputs.quantize as scheme
    import harness.port.quantized as layers

    digest = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (scheme, layers))).hexdigest()[:16]
    return {"quantize": f"{quantize}:{scheme.scheme_of(quantize).describe()}:{digest}"}


def assemble_rank_weights(states: list[dict[str, torch.Tensor]],
                          expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                          where: str = "the compiled graph") -> list[dict[str, torch.Tensor]]:
    """Per-rank dicts holding exactly the weights the graph reads, in its shapes and dtypes, from
    the ranks' checkpoint shards; one the graph reads but a shard lacks, or of another shape, is an
    error naming it.
    """
    out = []
    for rank, state in enumerate(states):
        weights, missing, wrong = {}, [], []
        for name, (shape, dtype) in sorted(expected.items()):
            tensor = state.get(name)
            if tensor is None:
                missing.append(name)
            elif tuple(tensor.shape) != tuple(shape):
                wrong.append(f"{name} {tuple(tensor.shape)} (graph expects {tuple(shape)})")
            else:
                weights[name] = tensor.to(dtype).contiguous()
        if missing or wrong:
            raise HarnessInputError(
                f"rank {rank}: weights do not fit {where}: "
                + (f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}; " if missing else "")
                + (f"wrong shape {wrong[:8]}; " if wrong else "")
                + "the checkpoint's spec or the sharding differs from the build (a stale cache entry?): "
                "delete the entry and run again")
        unused = sorted(set(state) - set(expected))
        if unused:  # a weight no graph reads: the device would run on something else (a folded constant)
            raise HarnessInputError(
                f"rank {rank}: checkpoint weights {unused[:8]}{' ...' if len(unused) > 8 else ''} are not read by "
                f"{where}: the graphs would run without them (a value folded at trace time?); the build and the "
                "checkpoint's spec differ: delete the cache entry and run again, or report the model code's bug")
        out.append(weights)
    return out


def graph_io(model, tags, module_weights: dict, kv_names, where: str) -> tuple[dict, dict]:
    """(weights, states) the compiled graphs `tags` of NxDModel `model` read, named by their
    metaneff: name -> (shape, dtype). Weight shapes are the module's (`module_weights`, the
    checkpoint layout recorded at build time): with weight layout optimisation the graphs' own weight
    inputs may have another layout, and set_weights takes the checkpoint's (NxD converts them).
    The states must be exactly the KV cache buffers `kv_names` (NxD zero-fills states; a buffer
    never reassigned in forward is a weight to NxD, not state); a weight the module lacks, a state
    that is not KV cache, a KV buffer that is not state, or a graph that does not carry every KV
    buffer as its own state (a draft graph reads the cache without writing it: harness/port/draft_graphs.py)
    is a GraphBuildError naming them, ending with `where` (what to do)."""
    from torch_neuronx.proto import metaneff_pb2
    from torch_neuronx.xla_impl.trace import get_torch_dtype

    weight_type = metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT
    state_type = metaneff_pb2.MetaTensor.Type.INPUT_STATE
    weights, states, kv, uncarried = {}, {}, set(kv_names), {}
    for tag in tags:
        mine = set()
        for t in model.get_metaneff(tag).input_tensors:
            key = _checkpoint_key(t)
            if t.type == weight_type and key and key not in kv:  # a KV buffer read as a weight: below
                if key not in module_weights:
                    raise GraphBuildError(f"graph {tag} reads weight {key!r}, which the traced module does not have; "
                                          f"{where}")
                weights[key] = module_weights[key]
            elif t.type == state_type and key:
                states[key] = (tuple(int(d) for d in t.shape), get_torch_dtype(t.data_type))
                mine.add(key)
        if kv - mine:  # a graph that does not carry a KV buffer would read it as a constant of its trace
            uncarried[tag] = sorted(kv - mine)
    unknown = sorted(set(states) - kv)
    if unknown:
        raise GraphBuildError(f"the compiled graphs keep state {unknown[:8]} that is not KV cache; the traced module "
                              f"reassigned a buffer it should not; {where}")
    missing = sorted(kv - set(states))
    if missing:
        raise GraphBuildError(f"KV cache buffers {missing[:8]} did not become aliased device state (a buffer NxD "
                              f"sees reassigned in no graph is a weight): the cache would not persist between calls; "
                              f"{where}")
    if uncarried:
        tag, names = next(iter(uncarried.items()))
        raise GraphBuildError(f"graph {tag} does not carry KV cache buffers {names[:4]} as state (every graph must "
                              "reassign every KV buffer: one it reads but never reassigns may be folded into the "
                              f"graph as its trace-time zeros); {where}")
    return weights, states


def _checkpoint_key(tensor_meta) -> str:
    """The state/weight key exactly as NxDModel keys its buffers: the raw checkpoint key."""
    key = tensor_meta.checkpoint_key
    return key.decode("utf-8") if isinstance(key, bytes) else str(key)


# ==== the weights the graphs read, as a cache entry records them =====================================

def _module_weight_shapes(module: nn.Module, kv_names) -> dict:
    """Every tensor of the traced module that is not KV state, in the layout the module holds it
    (the per-rank checkpoint layout): name -> (shape, dtype)."""
    kv = set(kv_names)
    return {name: (tuple(t.shape), t.dtype) for name, t in [*module.named_parameters(), *module.named_buffers()]
            if name not in kv}


def _dtype_key(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weight_shapes_to_json(shapes: dict) -> dict:
    return {name: [list(shape), _dtype_key(dtype)] for name, (shape, dtype) in sorted(shapes.items())}


def _weight_shapes_from_json(data: dict) -> dict:
    return {name: (tuple(shape), getattr(torch, dtype)) for name, (shape, dtype) in data.items()}


# ==== the weight-layout priority option ============================================================

# Off until a device run has measured the transform's peak: NxD's layout transform may hold both
# layouts on the core while it runs, 12.3-22.4 GiB per core for the 12B at TP 2 by the fit's own
# bounds (instances.core_bytes' layout_least/layout_most) against 16 GiB. `layout_priority=decode`
# turns it on; `info` prints the bounds either way.
DEFAULT_LAYOUT_PRIORITY: str | None = None

def _priority_key(layout_priority: str | None, kv_graphs: dict[str, tuple[int, int]]) -> str | None:
    """The tag ModelBuilder optimises the weight layout for: 'decode' (the decode graph at the
    smallest KV bucket), 'prefill' (the largest bucket's graph at the smallest KV bucket holding it)
    or None (no layout optimisation). Why the smallest KV bucket: every decode graph runs the same
    s=1 matmuls on the same weights (KV is state, not a weight), so any of them yields the same
    layout; at the smallest bucket weights are the largest share of the bytes read (the case the
    layout is for), and it is the cheapest graph to compile, and ModelBuilder compiles the priority
    graph alone before the others start."""
    if layout_priority in (None, "none"):
        return None
    by_length: dict[int, list[tuple[int, str]]] = {}
    for tag, (length, kv) in kv_graphs.items():
        by_length.setdefault(length, []).append((kv, tag))
    if layout_priority == "decode" or (layout_priority == "prefill" and len(by_length) == 1):
        return min(by_length[1])[1]
    if layout_priority == "prefill":
        return min(by_length[max(by_length)])[1]
    raise HarnessInputError(f"layout priority {layout_priority!r}: choose decode, prefill or none")


def _layout_priority(value) -> str | None:
    """The --backend-option layout_priority value: decode, prefill, or none (no layout optimisation)."""
    text = None if value is None else str(value).strip().lower()
    if text in (None, "none"):
        return None
    if text not in ("decode", "prefill"):
        raise ValueError("choose decode, prefill or none")
    return text
