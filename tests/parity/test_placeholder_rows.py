"""The per-layer table rows of a multimodal placeholder id (issue 45): the engine maps image, video
and audio placeholder ids to pad before its lookups, as transformers' wrapper does, and the rows'
stage judges against the reference's own placeholder-to-pad step (harness/reference/stream.py
text_ids). Placeholder ids inside the vocabulary, as transformers' own tester configs have them
(image 4, video 7, audio 8), so a generated token can be one."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.inputs.checkpoint import Checkpoint
from harness.parity.host_rows import judge_per_layer_rows
from harness.reference import stream

PLACEHOLDERS = {"image_token_id": 4, "video_token_id": 7, "audio_token_id": 8}


@functools.lru_cache(maxsize=None)
def _checkpoint():
    from harness.base.errors import CheckpointError, read_json_file
    from harness.inputs.tiny import TINY_FAMILY, cached_checkpoint

    config = read_json_file(TINY_FAMILY["e2b"], "config", CheckpointError, "")
    config.update(PLACEHOLDERS)
    return Checkpoint.open(cached_checkpoint(config, name="tiny-e2b-placeholders-in-vocab"))


def _judge(placeholder_in: str):
    ckpt = _checkpoint()
    assert set(ckpt.spec.placeholder_token_ids) == set(PLACEHOLDERS.values())
    engine = build_engine(ckpt, RunSettings(tp=1, dtype="bfloat16", buckets=(16,), kv_len=32))
    ids = [2, 17, 40, 4] if placeholder_in == "prompt" else [2, 17, 40]
    generated = [9, 7, 8] if placeholder_in == "generated" else [9, 11]
    return engine, [SimpleNamespace(prompt=ids, generated=generated)]


@pytest.mark.parametrize("placeholder_in", ["prompt", "generated"])
def test_placeholder_rows_pass_on_a_healthy_port(placeholder_in):
    engine, refs = _judge(placeholder_in)
    stage = judge_per_layer_rows(_checkpoint(), engine, refs)
    assert stage.passed and stage.differing == 0, stage.describe()
    assert stage.rows == len(set(refs[0].prompt) | set(refs[0].generated))  # the placeholder rows are judged


def test_a_port_that_skips_the_mapping_fails():
    engine, refs = _judge("generated")
    engine.placeholders = engine.placeholders[:0] - 1  # the host looks up the raw ids
    stage = judge_per_layer_rows(_checkpoint(), engine, refs)
    assert not stage.passed and stage.differing == 2, stage.describe()  # the rows of 7 and 8


def test_a_reference_that_skips_the_mapping_would_fail_the_healthy_port(monkeypatch):
    """The false alarm issue 45 saw ("94 of 95 rows bit-exact"): without the reference's own step."""
    engine, refs = _judge("generated")
    monkeypatch.setattr(stream, "text_ids", lambda spec, ids: ids)
    stage = judge_per_layer_rows(_checkpoint(), engine, refs)
    assert not stage.passed and stage.differing == 2, stage.describe()
