"""Double of neuronx-distributed 0.19.28492 (Neuron SDK 2.31): ModelBuilder v2, NxDModel,
NxDParallelState and the parallel linears, as exported by upstream's
src/neuronx_distributed/__init__.py (Release 2.29). Test-only (tests/nxd_double).

The import chain is upstream's too: the package imports `pipeline` before anything else, and the
pipeline's trace module imports `transformers.utils.fx.HFTracer` whenever transformers imports
(see tests/nxd_double/sdk/neuronx_distributed/pipeline/trace.py), so `import neuronx_distributed` fails under transformers 5 exactly as the
real package does."""

from . import parallel_layers, pipeline  # noqa: F401  (upstream order: kernels, parallel_layers, pipeline, ...)
from .trace.model_builder_v2 import ModelBuilder  # noqa: F401
from .trace.nxd_model import NxDModel  # noqa: F401
from .trace.parallel_context import NxDParallelState  # noqa: F401
