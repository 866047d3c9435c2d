"""Goldens of the family's variants: `gemma-parity reference` writes their own points (router
logits and expert weights, gated per-layer inputs; no cache for KV-shared layers), reading them
back checks every tensor against the spec, and `check --golden` passes on the clean port."""

from __future__ import annotations

import pytest

from harness.base.errors import GoldenError
from harness.reference.golden import make_golden, read_golden
from tests.family.shared import family_checkpoint
from tests.inputs.scenarios import rehash_golden


@pytest.mark.parametrize("variant", ["26b-a4b", "e4b"])
def test_family_golden_round_trip(tmp_path, variant):
    ckpt = family_checkpoint(variant)
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[5, 9, 12, 40, 41, 7, 3, 77, 90, 2, 11, 13, 17, 19, 23, 29, 31, 37]]")
    written = make_golden(ckpt.path, tmp_path / "golden", prompts, new_tokens=3)
    golden = read_golden(written.path, expected_spec=ckpt.spec)
    names = set(golden.results("float32")[0].captures)
    if ckpt.spec.moe is not None:
        assert {"layers.0.router_logits", "layers.0.expert_weights", "decode.layers.0.expert_weights"} <= names
    else:
        assert "layers.0.per_layer_input" in names
        assert not any(n.startswith(tuple(f"kv.{i}." for i in ckpt.spec.shared_layers)) for n in names)


def test_family_golden_with_a_foreign_tensor_is_refused(tmp_path):
    ckpt = family_checkpoint("e4b")
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[5, 9, 12, 40, 41, 7, 3, 77]]")
    written = make_golden(ckpt.path, tmp_path / "golden", prompts, new_tokens=2)
    shared = ckpt.spec.shared_layers[0]

    def add_shared_cache(tensors):  # a shared layer writes no cache: a forged golden holding one
        tensors[f"float32.p0.kv.{shared}.k"] = tensors["float32.p0.kv.0.k"].clone()

    rehash_golden(written.path, edit_tensors=add_shared_cache)
    with pytest.raises(GoldenError, match=f"kv.{shared}.k"):
        read_golden(written.path, expected_spec=ckpt.spec)


def test_golden_of_other_weights_is_not_re_run(tmp_path):
    """A golden written from other weights (same architecture) cannot be reproduced by this
    checkpoint: check judges against it as it is (no teacher-forced re-run) and says so."""
    from harness.base.settings import RunSettings
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_FAMILY, tiny_checkpoint
    from harness.parity.check import run_parity_check

    other = Checkpoint.open(tiny_checkpoint(1, TINY_FAMILY["26b-a4b"]))
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[5, 9, 12, 40, 41, 7, 3, 77, 90, 2, 11, 13]]")
    written = make_golden(family_checkpoint("26b-a4b").path, tmp_path / "golden", prompts, new_tokens=3)
    result = run_parity_check(other, other.path, RunSettings(buckets=(16,), kv_len=32), golden=written.path)
    assert not result.passed
    assert any("other weights" in n for n in result.notes) and not result.routing.rerouted
