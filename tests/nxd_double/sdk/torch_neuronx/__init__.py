"""Double of torch-neuronx 2.9.0.2.15 (SDK 2.31): only what neuronx-distributed's ModelBuilder v2
and the harness touch. Test-only (tests/nxd_double)."""

__version__ = "2.9.0.2.15.32035"

from . import proto, utils, xla_impl  # noqa: E402,F401
