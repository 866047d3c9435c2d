"""Double of neuronx-distributed 0.19.28492 (Neuron SDK 2.31): ModelBuilder v2, NxDModel,
NxDParallelState and the parallel linears, as exported by upstream's
src/neuronx_distributed/__init__.py (Release 2.29). Test-only (tests/nxd_double)."""

from . import parallel_layers  # noqa: F401
from .trace.model_builder_v2 import ModelBuilder  # noqa: F401
from .trace.nxd_model import NxDModel  # noqa: F401
from .trace.parallel_context import NxDParallelState  # noqa: F401
