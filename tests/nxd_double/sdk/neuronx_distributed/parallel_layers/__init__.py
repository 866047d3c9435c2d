from . import layers, parallel_state  # noqa: F401
