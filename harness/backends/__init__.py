"""Backends run the per-rank decoder: `cpu` here and in CI, `neuron` on inf2 (the only Neuron code),
`xla` (the device graphs through torch-xla on CPU, on the Neuron host's torch 2.9)."""

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
