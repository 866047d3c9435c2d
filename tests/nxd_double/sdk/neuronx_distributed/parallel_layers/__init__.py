from . import layers, mappings, parallel_state  # noqa: F401
