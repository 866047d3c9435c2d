"""Fixtures of the XLA lane: graphs of the tiny model lowered once per (tp, length, fault)."""

from __future__ import annotations

import pytest
import torch

KV_LEN = 64
BUCKET = 16


@pytest.fixture(scope="session")
def tiny_spec():
    from harness.inputs.spec import load_spec
    from harness.inputs.tiny import TINY_CONFIG

    return load_spec(TINY_CONFIG)


def lower_tiny(spec, tp: int, length: int, module_cls=None, dtype=torch.bfloat16):
    """One rank's graph of the tiny model (weights as the module initialised them), lowered by
    torch-xla: (LoweredGraph, GraphSignature, Expectation)."""
    from harness.backends.xla_lower import build_graph_module, graph_tensors, lower_graph
    from harness.hlo.expectation import GraphSignature, expectation_for
    from harness.port.graphs import TracedDecoder

    module = build_graph_module(spec, tp, KV_LEN, dtype, module_cls=module_cls or TracedDecoder)
    tensors, roles = graph_tensors(module)
    graph = lower_graph(module, tensors, roles, f"len{length}", length)
    return (graph, GraphSignature(graph.params, graph.outputs, graph.host_transfers),
            expectation_for(spec, tp, KV_LEN, length, dtype))


# A checkpoint the tool never saw: other widths, head counts, window and layer pattern, built by
# transformers' own classes (build_tiny_checkpoint -> Gemma4UnifiedForConditionalGeneration).
VARIANT_TEXT = {"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "global_head_dim": 64, "sliding_window": 8, "vocab_size": 640,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                "full_attention"], "num_hidden_layers": 5}


@pytest.fixture(scope="session")
def variant_dir(tmp_path_factory):
    import json

    from harness.inputs.tiny import TINY_CONFIG, build_tiny_checkpoint

    out = tmp_path_factory.mktemp("variant")
    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"].update(VARIANT_TEXT)
    path = out / "variant.json"
    path.write_text(json.dumps(config))
    return build_tiny_checkpoint(out / "checkpoint", seed=3, config_path=path)
