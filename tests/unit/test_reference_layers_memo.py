"""transformers' layer alone on one input is run once per check while the runs kept fit their budget:
the local verdicts' runs serve the bit-exact stage (harness/reference/layers.py ReferenceLayers.captures)."""

from __future__ import annotations

import torch

from harness.reference.layers import ReferenceLayers


def _counting(reference: ReferenceLayers) -> list:
    calls = []
    run = reference._run

    def counted(layer, index, x, dtype, **kwargs):
        calls.append((index, dtype))
        return run(layer, index, x, dtype, **kwargs)

    reference._run = counted
    return calls


def test_a_layer_run_on_the_same_input_is_computed_once_and_equal(tiny0_ckpt):
    reference = ReferenceLayers(tiny0_ckpt)
    calls = _counting(reference)
    x = torch.randn(5, tiny0_ckpt.spec.hidden_size)
    layer = reference.layer(0, torch.float32)
    first = reference.captures(layer, 0, x, torch.float32)
    again = reference.captures(layer, 0, x, torch.float32)
    assert len(calls) == 1 and first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    fresh = ReferenceLayers(tiny0_ckpt)._run(layer, 0, x, torch.float32, routes=None, per_layer_input=None)  # what a second run gives
    assert all(torch.equal(first[k], fresh[k]) for k in fresh)


def test_another_input_dtype_or_route_runs_again(tiny0_ckpt):
    reference = ReferenceLayers(tiny0_ckpt)
    calls = _counting(reference)
    x = torch.randn(5, tiny0_ckpt.spec.hidden_size)
    layers = {dt: reference.layer(0, dt) for dt in (torch.float32, torch.bfloat16)}
    reference.captures(layers[torch.float32], 0, x, torch.float32)
    reference.captures(layers[torch.float32], 0, x.clone(), torch.float32)  # equal values, another tensor
    reference.captures(layers[torch.bfloat16], 0, x, torch.bfloat16)
    reference.captures(layers[torch.float32], 0, x, torch.float32, routes=torch.zeros(5, 1, dtype=torch.long))
    assert len(calls) == 4


def test_nothing_is_kept_past_the_budget(tiny0_ckpt):
    reference = ReferenceLayers(tiny0_ckpt, memo_bytes=0)
    calls = _counting(reference)
    x = torch.randn(5, tiny0_ckpt.spec.hidden_size)
    layer = reference.layer(0, torch.float32)
    reference.captures(layer, 0, x, torch.float32)
    reference.captures(layer, 0, x, torch.float32)
    assert len(calls) == 2 and not reference._kept
