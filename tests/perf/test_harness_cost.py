"""The harness's own CPU cost, by construction rather than by timing (the timings are measured by
benchmarks/memory_reference.py and benchmarks/prefill_vs_transformers.py): the streaming reference
reads each layer once for all prompts, and the weights' NaN/Inf check is one reduction."""

from __future__ import annotations

import math

import pytest
import torch

from harness.inputs.checkpoint import _all_finite
from harness.reference.stream import stream_prefill_captures, stream_prefill_captures_many


def test_many_prompts_stream_in_one_pass_and_match_one_at_a_time(tiny0_ckpt, default_prompts, monkeypatch):
    prompts = default_prompts[:3]
    singles = [stream_prefill_captures(tiny0_ckpt, p, torch.float32) for p in prompts]
    reads = []
    original = type(tiny0_ckpt).layer_weights
    monkeypatch.setattr(type(tiny0_ckpt), "layer_weights",
                        lambda self, index, dtype=None: reads.append(index) or original(self, index, dtype))
    together = stream_prefill_captures_many(tiny0_ckpt, prompts, torch.float32)
    assert reads == list(range(tiny0_ckpt.spec.num_layers))  # each layer read once, for all prompts
    for single, joint in zip(singles, together):
        assert single.keys() == joint.keys()
        for name in single:
            assert torch.equal(single[name], joint[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_finite_check_finds_one_bad_element_anywhere(dtype, bad):
    tensor = torch.randn(64, 48).to(dtype)
    assert _all_finite(tensor)
    for index in [(0, 0), (63, 47), (17, 5)]:
        broken = tensor.clone()
        broken[index] = bad
        assert not _all_finite(broken), index
    assert _all_finite(torch.empty(0, dtype=dtype))
    big = torch.full((8,), torch.finfo(dtype).max, dtype=dtype)
    assert _all_finite(big) and _all_finite(-big)  # the largest finite values are finite
