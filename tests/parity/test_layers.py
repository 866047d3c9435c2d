"""Layered parity against the CPU fp32 reference: embeddings, every layer's three capture points,
final norm, logits and argmax at every prompt position, and greedy SEQ_MATCH. The port runs at TP=2
in bf16 on the CPU backend (and, under `-m neuron`, on the device), two seeds of the tiny model."""

from __future__ import annotations

import pytest

from harness.compare import ENVELOPE_FACTOR


def test_embeddings_within_envelope(port_check):
    """Host embeddings (scale cast to the weight dtype) match the reference's embedding output."""
    assert port_check.embeddings.passed, port_check.embeddings.explain()


@pytest.mark.parametrize("layer", range(12))
def test_layer_capture_points_within_envelope(port_check, layer):
    """Each decoder layer's attention residual, MLP residual and output stay within
    ENVELOPE_FACTOR x the bf16 CPU envelope of the fp32 reference."""
    result = port_check.layers[layer]
    assert result.passed, "\n".join(p.explain() for p in result.points)
    assert result.output.cosine > 0.999
    if port_check.local is not None:  # CPU: the layer alone on the reference's input passes too
        local = port_check.local[layer]
        assert local["pass"], local


def test_final_norm_within_envelope(port_check):
    assert port_check.final_norm.passed, port_check.final_norm.explain()


def test_no_real_divergence_at_any_prompt_position(port_check):
    """The port's argmax agrees with the reference at every prompt position, except near-tie
    flips whose reference margin is within bf16 noise."""
    for k, prompt in enumerate(port_check.prompts):
        bad = [m for m in prompt.prefill.mismatches if m.kind == "divergence"]
        assert not bad, f"prompt {k}: real divergences {bad}"
        assert prompt.prefill.top1_agreement >= 0.8, f"prompt {k}: {prompt.prefill}"


def test_greedy_decode_matches_reference(port_check):
    """Greedy decode is token-for-token identical to the fp32 reference (SEQ_MATCH), or departs
    only at a classified near tie; teacher-forced logits after that keep agreeing."""
    for k, prompt in enumerate(port_check.prompts):
        assert prompt.decode.divergences == 0, f"prompt {k}: {prompt.decode.mismatches}"
        if not prompt.seq_match:
            step = prompt.first_mismatch
            assert any(m.position == step and m.kind == "near_tie" for m in prompt.decode.mismatches), (
                f"prompt {k} departs at step {step} without a near tie:\n"
                f"  reference {prompt.reference_tokens}\n  device    {prompt.device_tokens}")
    assert port_check.passed


def test_healthy_port_sits_near_envelope(port_check):
    """The tolerance has headroom on a healthy port: ratios well under ENVELOPE_FACTOR (the numbers
    behind the factor's comment in compare.py)."""
    worst = max(p.required_factor for layer in port_check.layers for p in layer.points)
    print(f"worst envelope ratio on a healthy port: {worst:.2f} (tolerance {ENVELOPE_FACTOR})")
    assert worst < ENVELOPE_FACTOR / 2


def test_logit_margins_show_clear_top1(tiny_reference):
    """Fixture sanity (DESIGN §6): the tiny model's reference top-1 margins sit mostly well above
    bf16 noise, so agreement tests measure the port, not coin flips. Prints the distribution."""
    import torch

    margins = []
    for r in tiny_reference["float32"]:
        top2 = r.captures["logits"].topk(2, -1).values
        margins.append(top2[:, 0] - top2[:, 1])
    margins = torch.cat(margins)
    q = torch.quantile(margins, torch.tensor([0.1, 0.5, 0.9]))
    print(f"top-1 margin quantiles (10/50/90%): {q.tolist()}")
    # bf16 ULP at |logit| ~ 16-32 is 0.125: the median margin should be many ULPs
    assert float(q[1]) > 4 * 0.125
