"""The NxD side of the traced module: NeuronLinears (NxD's column/row-parallel layers in place of
the CPU backend's linears and collectives), the per-rank weight dicts NxDModel.set_weights takes,
and the weight-layout priority option. Imported by harness/backends/neuron.py only; NxD itself is
imported inside functions (through neuron_env.import_neuronx_distributed), so this module imports
on any CPU machine."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from harness.backends.neuron_env import import_neuronx_distributed
from harness.errors import HarnessInputError
from harness.model import RankLinears

# ==== the NxD layers of the traced module (harness/graphs.py defines the module) ====================

def _nxd_layers():
    """neuronx_distributed.parallel_layers.layers, imported through import_neuronx_distributed."""
    import_neuronx_distributed()
    from neuronx_distributed.parallel_layers import layers

    return layers


class NeuronLinears(RankLinears):
    """Projections as NxD parallel layers. Sizes passed in are per rank (as RankDecoder asks);
    NxD layers take the full size and divide by the TP degree themselves. `reduce_dtype`: the dtype
    the row-parallel partial sums are all-reduced in (fp32, as the CPU backend does; NxD-Inference's
    models reduce in the model dtype)."""

    def __init__(self, tp: int, dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32):
        super().__init__()
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
        if unused and rank == 0:
            warnings.warn(f"checkpoint weights {unused[:8]} are not read by {where}", stacklevel=2)
        out.append(weights)
    return out


def _checkpoint_key(tensor_meta) -> str:
    """The state/weight key exactly as NxDModel keys its buffers: the raw checkpoint key."""
    key = tensor_meta.checkpoint_key
    return key.decode("utf-8") if isinstance(key, bytes) else str(key)


def _layout_priority(value) -> str | None:
    """The --backend-option layout_priority value: decode, prefill, or none (no layout optimisation)."""
    text = None if value is None else str(value).strip().lower()
    if text in (None, "none"):
        return None
    if text not in ("decode", "prefill"):
        raise ValueError("choose decode, prefill or none")
    return text
