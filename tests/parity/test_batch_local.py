"""The local layer verdicts after a batched run (issue 37's crash): `check --batch 4` with four
prompts in the first bucket ended in an exception inside eager_attention, because the layer run
alone inherited the four slots the batch's last call had named. A layer alone on a batched build
runs as one sequence, exactly as on a batch-1 build."""

from __future__ import annotations

import torch

from harness.parity.layer_alone import port_layer_captures
from harness.port.decode import generate
from tests.parity.batch_support import batch_engine, random_prompts


def test_a_layer_alone_after_a_full_batch_equals_the_batch_1_build(tiny0_ckpt):
    be = batch_engine(tiny0_ckpt, batch=4, buckets=(32,), kv_len=64)
    one = batch_engine(tiny0_ckpt, batch=1, buckets=(32,), kv_len=64).backend
    prompts = random_prompts(tiny0_ckpt.spec.vocab_size, (5, 9, 14, 20), seed=3)  # every row in one bucket
    generate(be, prompts, 2, capture=True)  # its last call names all four slots
    x = torch.randn(14, tiny0_ckpt.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    alone = port_layer_captures(be.backend, 0, x)
    expected = port_layer_captures(one, 0, x)
    assert alone.keys() == expected.keys()
    for name, value in expected.items():
        assert alone[name].shape == value.shape, name
        assert torch.equal(alone[name], value), name
