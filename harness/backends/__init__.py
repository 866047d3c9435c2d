"""Backends run the per-rank decoder: `cpu` here and in CI, `neuron` on inf2 (the only Neuron code),
`xla` (the device graphs through torch-xla on CPU, on the Neuron host's torch 2.9).

`build_engine` puts a backend behind the host engine: what every workflow runs.
"""

import torch

from harness.engine import DEFAULT_BUCKETS, DEFAULT_KV_LEN, Engine

BACKENDS = ("cpu", "neuron", "xla")


def make_backend(name: str, checkpoint, **kwargs):
    """Build a backend by name; the Neuron one is imported only when asked for."""
    if name == "cpu":
        from harness.backends.cpu import CpuBackend

        return CpuBackend(checkpoint, **kwargs)
    if name == "neuron":
        from harness.backends.neuron import NeuronBackend

        return NeuronBackend(checkpoint, **kwargs)
    if name == "xla":
        from harness.backends.xla import XlaBackend

        return XlaBackend(checkpoint, **kwargs)
    from harness.errors import HarnessInputError

    raise HarnessInputError(f"unknown backend {name!r}; choose one of {BACKENDS}")


def build_engine(checkpoint, backend: str = "cpu", tp: int = 2, dtype: torch.dtype = torch.bfloat16,
                 buckets=DEFAULT_BUCKETS, kv_len: int = DEFAULT_KV_LEN, **backend_kwargs) -> Engine:
    """The host engine over a `backend` built for this checkpoint (per-rank weights, TP, buckets)."""
    be = make_backend(backend, checkpoint, tp=tp, dtype=dtype, max_len=kv_len, buckets=tuple(buckets),
                      **backend_kwargs)
    return Engine(checkpoint.spec, be, checkpoint.embed_weight(dtype), buckets=buckets, kv_len=kv_len,
                  per_layer_table=checkpoint.per_layer_table(dtype) if checkpoint.spec.per_layer_input_size else None)
