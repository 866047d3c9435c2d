"""Ill-conditioned gated per-layer inputs (E2B/E4B) teacher-forced (the rule harness/parity/forced_path.py
add_pins, applied by harness/parity/observe.py follow_port_path; harness/reference/forcing.py force_inputs):
where a gated per-layer input row has no direction at bf16 precision, the layer's post-norm scales
noise up to full size; the references take the port's row there, so a healthy port is not failed
for it, while every PLE fault still is (tests/faults/test_family_faults.py)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.judge.compare import PLE_PIN_NOISE
from harness.parity import forced_path
from harness.reference.forcing import Forced
from harness.reference.run import rerun_reference
from tests.family.shared import family_checkpoint, family_reference


def test_expected_error_counts_cancellation_and_the_gate_tail():
    gated = torch.tensor([[3.0, 4.0], [0.03, 0.04], [3.0, 4.0]])
    pre = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, -4.0]])
    rel = forced_path._expected_rel_error(gated, pre, (0.1, 0.0))  # no gate noise: typical / row norm
    assert torch.allclose(rel, torch.tensor([0.02, 2.0, 0.02]), atol=1e-6)
    rel = forced_path._expected_rel_error(gated, pre, (0.0, 0.1))
    # element 2 of row 2 sits at gelu(-4): moving a by 0.1 changes gelu by ~50%, its share of the
    # row (4 of 5) more than gelu(1)'s 13% moves the first element's
    act = torch.nn.functional.gelu(pre, approximate="tanh")
    moved = torch.nn.functional.gelu(pre + 0.1, approximate="tanh")
    want = ((moved - act) * gated / act).norm(dim=-1) / gated.norm(dim=-1)
    assert torch.allclose(rel, want) and rel[2] > 3 * rel[0] and rel[2] > PLE_PIN_NOISE


def test_forced_gated_input_is_taken_at_its_position_only():
    ckpt, refs = family_checkpoint("e2b"), family_reference("e2b")
    r32 = refs["float32"][1:2]
    name = "layers.2.per_layer_input"
    value = torch.full_like(r32[0].captures[name][3], 0.5)
    again = rerun_reference(ckpt.path, "float32", [r32[0].generated], (r32, [Forced(inputs={2: {3: value}})]))[0]
    before, after = r32[0].captures, again.captures
    assert torch.equal(after[name][3], value)
    assert torch.allclose(after[name][:3], before[name][:3], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after["layers.2.output"][3], before["layers.2.output"][3], atol=1e-2)
    assert torch.allclose(after["layers.2.output"][:3], before["layers.2.output"][:3], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_healthy_ple_port_needs_the_pins(monkeypatch):
    """The tiny E4B (seed 0) on the default prompts: without pins the healthy port fails on a row
    whose gated input is near zero; with them it passes."""
    from harness.base.settings import RunSettings
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_FAMILY, tiny_checkpoint
    from harness.parity.check import run_parity_check

    ckpt = Checkpoint.open(tiny_checkpoint(0, TINY_FAMILY["e4b"]))
    result = run_parity_check(ckpt, ckpt.path, RunSettings())
    assert result.passed, result.failures()
    assert any("gated per-layer input rows" in n for n in result.notes + result.fp32.notes)
    monkeypatch.setattr(forced_path, "PLE_PIN_NOISE", math.inf)
    unpinned = run_parity_check(ckpt, ckpt.path, RunSettings())
    assert not unpinned.passed
