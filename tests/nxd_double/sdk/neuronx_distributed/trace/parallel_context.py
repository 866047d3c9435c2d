"""NxDParallelState of the double (upstream: src/neuronx_distributed/trace/parallel_context.py and
utils/model_utils.py get_platform_lnc, Release 2.29).

NxDParallelState(world_size=1, rank=0, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
context_parallel_size=1, expert_model_parallel_size=1, lnc_size=None). With lnc_size=None the LNC
comes from $NEURON_LOGICAL_NC_CONFIG, else from the platform (torch_neuronx.utils.get_platform_target(),
which fails on a host without a Neuron device): trn2/trn3 -> 2, others -> 1.
"""

from __future__ import annotations

import os

from torch_neuronx.utils import get_platform_target

from ..parallel_layers import parallel_state


def get_platform_lnc() -> int:
    env = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", -1))
    if env != -1:
        return env
    return 2 if get_platform_target() in ("trn2", "trn3") else 1


class NxDParallelState:
    def __init__(self, world_size=1, rank=0, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                 context_parallel_size=1, expert_model_parallel_size=1, lnc_size=None):
        self.world_size, self.rank = world_size, rank
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.context_parallel_size = context_parallel_size
        self.expert_model_parallel_size = expert_model_parallel_size
        self.lnc_size = lnc_size if lnc_size is not None else get_platform_lnc()

    def __enter__(self):
        if self.world_size % self.tensor_model_parallel_size:
            raise RuntimeError(f"world size {self.world_size} is not divisible by tp {self.tensor_model_parallel_size}")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            skip_collective_init=True, lnc_size=self.lnc_size)
        parallel_state._STATE["world"] = self.world_size
        return self

    def __exit__(self, exc_type, exc, tb):
        parallel_state.destroy_model_parallel()
