"""The port: the per-rank decoder, its tensor-parallel plan, the device graphs and the host engine."""
