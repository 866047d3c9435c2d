"""Long context on the tiny model at a window of 8 (tests/faults/catalog.py, LONG): prompts of 2-4
windows prefilled in chunks of 12 and 4 (chunks longer and shorter than the window), 8 decode
steps past the window, the sliding layers in a ring of 8 slots or in the linear cache. The check
passes token for token in fp32 against transformers at TP=1 and TP=2 with either cache, the ring's
memory is its window whatever the KV length, and bisect names layer 0 for each long-context fault."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.judge.compare import rel_l2
from harness.parity.check import check_port
from harness.port.engine import chunk_plan
from tests.faults.catalog import CATALOG, LONG, LONG_BUCKETS, LONG_KV_LEN, LONG_WINDOW, engine_options
from harness.port.decode import generate

FP32_ROUNDING = 1e-5
# bisect on one long-context fault in the default lane (the ring's trap), the rest in the slow lane
# bisect on the long fixture's faults: the slow lane (the default lane's fault catalog checks the
# chunked-prefill fault on the same fixture).
LONG_FAULTS = [pytest.param(f, id=f.name, marks=pytest.mark.slow) for f in CATALOG if f.checkpoint == LONG]


def _engine(ckpt, tp=2, dtype=torch.float32, sliding_cache="ring", kv_len=LONG_KV_LEN):
    settings = RunSettings(tp=tp, dtype=dtype, buckets=LONG_BUCKETS, kv_len=kv_len, sliding_cache=sliding_cache)
    return build_engine(ckpt, settings, capture=True)


def test_fixture_spans_windows_and_chunks(long_ckpt, long_prompts):
    """What the fixture exercises: every prompt 2-4 windows long, several chunks each, chunks longer
    and shorter than the window, and a chunk that wraps the ring."""
    assert all(layer.window in (None, LONG_WINDOW) for layer in long_ckpt.spec.layers)
    for prompt in long_prompts:
        assert 2 * LONG_WINDOW <= len(prompt) <= 5 * LONG_WINDOW
        assert len(chunk_plan(len(prompt), LONG_BUCKETS, LONG_KV_LEN)) >= 2
    lengths = {length for p in long_prompts for _, length, _ in chunk_plan(len(p), LONG_BUCKETS, LONG_KV_LEN)}
    assert min(lengths) < LONG_WINDOW < max(lengths)


@pytest.mark.parametrize("sliding_cache, tp", [("ring", 2), ("linear", 1),  # the other two pairs: slow
                                               pytest.param("ring", 1, marks=pytest.mark.slow),
                                               pytest.param("linear", 2, marks=pytest.mark.slow)])
def test_long_prompts_pass_in_fp32_token_for_token(long_ckpt, long_reference, tp, sliding_cache):
    """The fp32 port against the fp32 reference at every capture point (chunk boundaries at 12 and 24,
    window edges at 8, 16, 24, 32), the KV cache after prefill and after every decode step (a ring
    read back in absolute positions), and the same greedy tokens."""
    engine = _engine(long_ckpt, tp=tp, sliding_cache=sliding_cache)
    result = check_port(long_ckpt, engine, long_reference["float32"], long_reference["bfloat16"], local=False,
                        fp32_engine=None)
    result = result.bf16
    assert result.passed, result.failures()[:3]
    assert result.kv and any(p.name.startswith("decode.kv.") for p in result.kv)
    for ref in long_reference["float32"]:
        assert generate(engine, [ref.prompt], len(ref.generated))[0].tokens == ref.generated


def test_ring_memory_is_the_window_whatever_the_kv_length(long_ckpt):
    """Sliding layers hold `window` slots under the ring at any KV length; full layers (and every
    layer under the linear cache) hold kv_len slots."""
    for kv_len in (32, 48):
        ring = _engine(long_ckpt, kv_len=kv_len).backend.ranks[0]
        linear = _engine(long_ckpt, kv_len=kv_len, sliding_cache="linear").backend.ranks[0]
        for layer, spec in zip(ring.layers, long_ckpt.spec.layers):
            slots = LONG_WINDOW if spec.is_sliding else kv_len
            assert layer.self_attn.cache.k.shape[2] == layer.self_attn.cache.v.shape[2] == slots
        assert all(layer.self_attn.cache.k.shape[2] == kv_len for layer in linear.layers)


def test_ring_reads_back_the_linear_caches_last_window(long_ckpt, long_prompts):
    """After a prefill of 33 positions and after decode steps, the ring unrolled into absolute
    positions equals the last window of the linear cache (both fp32, same arithmetic)."""
    ring, linear = _engine(long_ckpt), _engine(long_ckpt, sliding_cache="linear")
    prompt = long_prompts[-1]
    for engine in (ring, linear):
        generate(engine, [prompt], 3)[0]
    written = len(prompt) + 2
    for i, ((rk, rv), (lk, lv)) in enumerate(zip(ring.read_cache(written), linear.read_cache(written))):
        held = LONG_WINDOW if long_ckpt.spec.layers[i].is_sliding else written
        assert rk.shape[1] == held
        assert rel_l2(rk, lk[:, written - held:]) < FP32_ROUNDING and rel_l2(rv, lv[:, written - held:]) < FP32_ROUNDING


@pytest.mark.parametrize("fault", LONG_FAULTS)
def test_bisect_names_layer_zero(request, monkeypatch, long_ckpt, long_reference, fault):
    """bisect (capture mode: each layer alone on the reference's input, in the engine's chunks)
    names the first sliding layer and its attention for every long-context fault."""
    from harness.parity.bisect import bisect_capture

    fault.inject(monkeypatch)
    engine = build_engine(long_ckpt, RunSettings(**engine_options(LONG)), capture=True)
    result = bisect_capture(long_ckpt, engine, (long_reference["float32"], long_reference["bfloat16"]))
    assert result.first_divergent_layer == 0, result.first_divergent_layer
    assert result.component == "attention"


@pytest.mark.slow
def test_bisect_names_layer_zero_for_a_decode_kv_bucket_one_too_small(monkeypatch, tiny0_ckpt, tiny0_reference):
    """A decode-only fault (decode steps read the KV bucket below the one holding their positions):
    bisect's capture mode runs the check's decode points too, and names layer 0's attention."""
    from harness.parity.bisect import bisect_capture

    fault = next(f for f in CATALOG if f.name == "decode-kv-bucket-one-too-small")
    fault.inject(monkeypatch)
    engine = build_engine(tiny0_ckpt, RunSettings(**engine_options(fault.checkpoint)), capture=True)
    result = bisect_capture(tiny0_ckpt, engine, (tiny0_reference["float32"], tiny0_reference["bfloat16"]))
    assert not result.passed
    assert result.first_divergent_layer == 0 and result.component == "attention"
