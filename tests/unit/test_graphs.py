"""The device-graph definition is one module, shared by the compiled backends, and knows no SDK."""

from __future__ import annotations

import pytest

from harness.backends import neuron
from harness.port import graphs
from tests.sdk_free import SDK_MODULES, import_without_sdks


def test_graphs_module_imports_no_sdk(monkeypatch):
    module = import_without_sdks(monkeypatch, graphs.__file__, "graphs_fresh_copy")
    assert callable(module.TracedDecoder) and callable(module.graph_plan)
    text = open(graphs.__file__).read()
    for name in SDK_MODULES:
        assert f"import {name}" not in text and f"from {name}" not in text


@pytest.mark.parametrize("name", ["TracedDecoder", "graph_plan", "tag_for_length", "example_inputs",
                                  "unpack_outputs", "kv_buffer_names", "constant_buffers", "POSITION_DTYPE"])
def test_neuron_backend_uses_the_shared_definition(name):
    assert getattr(neuron, name) is getattr(graphs, name)


def test_the_graph_definition_is_part_of_the_neuron_cache_key():
    assert any(p.name == "graphs.py" for p in neuron.MODEL_SOURCE_FILES)
