"""Import a harness module afresh with every accelerator SDK import made to fail: proves that its
SDK imports are all lazy (it loads on any CPU machine)."""

from __future__ import annotations

import importlib.util
import sys

SDK_MODULES = ("torch_neuronx", "neuronx_distributed", "torch_xla", "libneuronxla", "neuronxcc")


def import_without_sdks(monkeypatch, path: str, name: str):
    for sdk in SDK_MODULES:
        monkeypatch.setitem(sys.modules, sdk, None)  # `import sdk` now raises ImportError
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
