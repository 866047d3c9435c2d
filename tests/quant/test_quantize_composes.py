"""`--quantize` composes with the other run settings (docs/quantization.md#composition): for any
combination of TP degree, batch slots, sliding cache, dtype and model shape, the int8 port on the
checkpoint computes bit for bit what the unquantized port computes on the quantized model's
checkpoint (the same dequantized weights), so the quantized path adds nothing but its weights."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.inputs.checkpoint import Checkpoint
from harness.inputs.quantized_checkpoint import quantized_reference

MODELS = ("tiny", "tiny-e2b", "tiny-26b-a4b")


@functools.lru_cache(maxsize=None)
def _checkpoints(model: str):
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY, tiny_checkpoint

    config = TINY_CONFIG if model == "tiny" else TINY_FAMILY[model.removeprefix("tiny-")]
    ckpt = Checkpoint.open(tiny_checkpoint(seed=0, config_path=config))
    return ckpt, quantized_reference(ckpt, "int8")


def _logits(ckpt, run: RunSettings, ids: list[list[int]]) -> torch.Tensor:
    engine = build_engine(ckpt, run)
    embeds = torch.cat([engine.embed(torch.tensor(row)) for row in ids])
    positions = torch.arange(len(ids[0]))[None].expand(len(ids), -1).contiguous()
    seq_ids = torch.arange(len(ids)).flip(0) if run.batch > 1 else None
    return engine.backend.forward(embeds, positions, seq_ids=seq_ids)[0]


def _compare(model, tp, batch, sliding_cache, dtype):
    ckpt, int8 = _checkpoints(model)
    run = RunSettings(tp=tp, batch=batch, sliding_cache=sliding_cache, dtype=dtype, buckets=(8,), kv_len=16)
    ids = [[2, 17, 33, 4, 9, 71, 5, 12], [2, 8, 10, 42, 7, 13, 3, 8]][:batch]
    quantized = _logits(ckpt, run.but(quantize="int8"), ids)
    assert torch.equal(quantized, _logits(int8, run, ids))
    assert not torch.equal(quantized, _logits(ckpt, run, ids))  # and the weights are the quantized ones


def test_quantize_composes_with_tp_batch_and_ring_cache_on_the_12b_shape():
    """The default lane's instance: TP 2, two KV slots, the ring cache, bf16."""
    _compare("tiny", 2, 2, "ring", "bfloat16")


@pytest.mark.slow  # ~60 CPU-seconds (family checkpoints, 12 combinations); default-lane sibling: the case above
@settings(max_examples=12, deadline=None)
@given(model=st.sampled_from(MODELS), tp=st.sampled_from((1, 2)), batch=st.sampled_from((1, 2)),
       sliding_cache=st.sampled_from(("linear", "ring")), dtype=st.sampled_from(("bfloat16", "float32")))
def test_quantize_composes_with_every_run_setting(model, tp, batch, sliding_cache, dtype):
    _compare(model, tp, batch, sliding_cache, dtype)


def test_unknown_scheme_is_refused_naming_it():
    from harness.base.errors import OptionError

    with pytest.raises(OptionError, match="--quantize 'int4': use one of int8"):
        RunSettings(quantize="int4")


@pytest.mark.slow  # a speculative check (~15 CPU-seconds); default-lane sibling: test_quantize_composes_with_tp_batch_and_ring_cache_on_the_12b_shape
def test_quantize_composes_with_speculative_decoding(tmp_path):
    """`check --quantize int8 --assistant A --speculate 3`: the int8 target (its drafter unquantized)
    passes, speculative stage included, against the quantized model."""
    import json

    from harness.cli import main
    from harness.reference.mirror_assistant import mirror_pair
    from tests.quant.conftest import SHORT_PROMPTS

    target, assistant = mirror_pair(0)
    prompts, out = tmp_path / "prompts.json", tmp_path / "check.json"
    prompts.write_text(json.dumps(SHORT_PROMPTS))
    assert main(["check", "--checkpoint", str(target), "--assistant", str(assistant), "--speculate", "3",
                 "--prompts", str(prompts), "--new-tokens", "6", "--tp", "2", "--batch", "1", "--skip-served-build",
                 "--quantize", "int8", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["provenance"]["settings"]["run"]["quantize"] == "int8"
    assert any("speculative" in json.dumps(stage) for stage in payload.get("extra_stages", [payload]))
