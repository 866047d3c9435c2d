"""The double's `neuronx_distributed.pipeline` (upstream: pipeline/__init__.py imports its model
module, which imports pipeline/trace.py). Only the import chain is modelled: no pipeline
parallelism."""

from . import trace  # noqa: F401
