"""`--quantize int8` on the neuron backend through the NxD contract double (tests/nxd_double): the
traced module holds int8 weights and fp32 scales per rank, the compile-cache key tells a quantized
build from the unquantized one (`check --quantize int8` through the double on every model and TP:
tests/quant/test_quantized_matrix.py)."""

from __future__ import annotations

import pytest
import torch

from harness.backends.neuron_layers import quantize_key


def test_quantize_key_is_empty_for_the_unquantized_build():
    """An unquantized build's cache key is what it was; a quantized one names its scheme."""
    assert quantize_key(None) == {}
    assert quantize_key("int8")["quantize"].startswith("int8:")


@pytest.mark.slow  # a traced build through the double (~13 CPU-seconds); default-lane sibling: test_quantize_key_is_empty_for_the_unquantized_build
def test_neuron_rank_weights_are_int8_with_fp32_scales(nxd, tiny0_ckpt):
    from harness.backends import build_engine
    from harness.base.settings import RunSettings

    engine = build_engine(tiny0_ckpt, RunSettings(backend="neuron", tp=2, buckets=(16,), kv_len=64, quantize="int8"))
    specs = engine.backend.weight_specs
    q = specs["layers.0.self_attn.q_proj.weight"]
    s = specs["layers.0.self_attn.q_proj.scale"]
    assert q[1] == torch.int8 and s[1] == torch.float32 and tuple(s[0]) == (q[0][0], 1)
    assert specs["lm_head.weight"][1] == torch.bfloat16  # kept full precision


@pytest.mark.slow  # two traced builds through the double (~20 CPU-seconds); default-lane sibling: test_quantize_key_is_empty_for_the_unquantized_build
@pytest.mark.parametrize("name", ["e2b", "26b-a4b"])
def test_family_int8_on_the_double_is_the_cpu_backends_bit_for_bit(nxd, name):
    """The family's int8 port through the double computes the cpu backend's logits exactly (and
    passes check itself: tests/quant/test_quantized_matrix.py)."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_FAMILY, tiny_checkpoint

    ckpt = Checkpoint.open(tiny_checkpoint(seed=0, config_path=TINY_FAMILY[name]))
    ids = torch.tensor([2, 17, 33, 4, 9, 71, 5, 12])
    logits = {}
    for backend in ("cpu", "neuron"):
        engine = build_engine(ckpt, RunSettings(backend=backend, tp=2, buckets=(8,), kv_len=16, quantize="int8"),
                              capture=backend == "neuron")
        logits[backend] = engine.prefill(ids).logits
    assert torch.equal(logits["cpu"], logits["neuron"])
