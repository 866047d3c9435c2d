from . import metaneff_pb2  # noqa: F401
