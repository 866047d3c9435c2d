"""Import-time behaviour of upstream's src/neuronx_distributed/pipeline/trace.py (Release 2.29).

Upstream decides "transformers is available" by whether `from transformers import PreTrainedModel`
succeeds (utils/model_utils.py), and then, at import time, imports `HFTracer` from
`transformers.utils.fx` and subclasses it. transformers 5 has no `transformers.utils.fx`, so there
the import of neuronx_distributed itself fails with ModuleNotFoundError. The tracer classes are not
modelled beyond being defined.
"""

try:
    from transformers import PreTrainedModel  # noqa: F401
    TRANSFORMERS_AVAILABLE = True
except ImportError:
    TRANSFORMERS_AVAILABLE = False

if TRANSFORMERS_AVAILABLE:
    from transformers.utils.fx import HFTracer

    class HFTracerWrapper(HFTracer):
        """Defined at import time, as upstream's is; never used by the port."""
