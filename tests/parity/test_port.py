"""The port's mechanics on CPU: fp32 exactness against transformers, TP=2 == TP=1, KV-cache decode
== recompute, padding and bucket edges, the sliding window in prefill and decode, placeholders."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.errors import PromptError
from harness.base.settings import RunSettings
from harness.judge.compare import rel_l2
from harness.port.decode import generate

FP32_ROUNDING = 1e-5  # relative L2 of fp32 computations that differ only in summation order


def _engine(ckpt, tp=2, dtype=torch.float32, buckets=(16, 32, 64, 256), kv_len=256):
    return build_engine(ckpt, RunSettings(tp=tp, dtype=dtype, buckets=buckets, kv_len=kv_len))


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_port_matches_reference_at_every_point(tiny_ckpt, tiny_reference, tp):
    """In fp32 the port equals transformers' eager reference to fp32 rounding at every capture."""
    engine = _engine(tiny_ckpt, tp=tp)
    for ref in tiny_reference["float32"]:
        pre = engine.prefill(ref.prompt, capture=True)
        pre.captures["logits"] = pre.logits
        for name, dev in pre.captures.items():
            err = rel_l2(dev, ref.captures[name])
            assert err < FP32_ROUNDING, f"{name}: rel_l2 {err:.2e} (prompt of {len(ref.prompt)} tokens)"


def test_tp2_equals_tp1(tiny0_ckpt, default_prompts):
    """Sharding changes nothing but summation order: TP=2 equals TP=1 in fp32 to rounding (same
    tokens); in bf16 TP=2 departs from TP=1 by no more than bf16 itself departs from fp32."""
    runs = {(tp, dtype): _engine(tiny0_ckpt, tp=tp, dtype=dtype)
            for tp in (1, 2) for dtype in (torch.float32, torch.bfloat16)}
    for prompt in default_prompts:
        out = {key: generate(engine, [prompt], 4)[0] for key, engine in runs.items()}
        one32, two32 = out[(1, torch.float32)], out[(2, torch.float32)]
        assert rel_l2(two32.prefill.logits, one32.prefill.logits) < FP32_ROUNDING
        assert one32.tokens == two32.tokens
        one16, two16 = out[(1, torch.bfloat16)].prefill.logits, out[(2, torch.bfloat16)].prefill.logits
        bf16_noise = rel_l2(one16, one32.prefill.logits)
        assert rel_l2(two16, one16) < 2 * bf16_noise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_cache_equals_recompute(tiny0_ckpt, dtype):
    """Decode with the on-device KV cache gives the logits of recomputing the whole sequence, also
    past the sliding window (prompt 12 + 12 tokens crosses window 16)."""
    engine = _engine(tiny0_ckpt, dtype=dtype)
    prompt = list(range(20, 32))
    run = generate(engine, [prompt], 12)[0]
    full = engine.prefill(prompt + run.tokens[:-1]).logits[len(prompt) - 1:]
    bound = FP32_ROUNDING if dtype == torch.float32 else 1e-2
    assert rel_l2(run.step_logits, full) < bound
    assert full.argmax(-1).tolist() == run.tokens


def test_padding_never_changes_real_positions(tiny0_ckpt):
    """The same prompt in a 16-, 32- and 64-token bucket gives the same logits at real positions."""
    prompt = list(range(100, 111))
    logits = [_engine(tiny0_ckpt, buckets=(b,)).prefill(prompt).logits for b in (16, 32, 64)]
    for other in logits[1:]:
        assert rel_l2(other, logits[0]) < FP32_ROUNDING


def test_prompt_exactly_a_bucket_uses_that_bucket(tiny0_ckpt, tiny0_reference):
    engine = _engine(tiny0_ckpt, buckets=(16, 32))
    ref = tiny0_reference["float32"][1]  # 24 tokens
    prompt16 = ref.prompt[:16]
    result = engine.prefill(prompt16)
    assert result.bucket == 16
    assert engine.prefill(ref.prompt).bucket == 32
    # a prompt exactly the bucket's size still computes the right thing
    assert rel_l2(result.logits, ref.captures["logits"][:16]) < FP32_ROUNDING


@pytest.mark.parametrize("sliding_cache", ["linear", "ring"])
def test_prompt_longer_than_largest_bucket_is_prefilled_in_chunks(tiny0_ckpt, sliding_cache):
    """33 tokens through buckets (8, 16): chunks 16 + 16 + 1 (the decode graph) give the logits of
    one 64-token bucket; a prompt longer than the KV length is refused."""
    prompt = list(range(40, 73))
    whole = _engine(tiny0_ckpt, buckets=(64,), kv_len=64).prefill(prompt)
    engine = build_engine(tiny0_ckpt, RunSettings(tp=2, dtype=torch.float32, buckets=(8, 16), kv_len=64,
                                                  sliding_cache=sliding_cache))
    chunked = engine.prefill(prompt)
    assert chunked.logits.shape == whole.logits.shape
    assert rel_l2(chunked.logits, whole.logits) < FP32_ROUNDING
    with pytest.raises(PromptError, match="longer than the KV length 64"):
        engine.prefill(list(range(65)))


def test_decode_past_kv_length_is_refused(tiny0_ckpt):
    engine = _engine(tiny0_ckpt, buckets=(16,), kv_len=24)
    with pytest.raises(PromptError, match="KV length"):
        generate(engine, [list(range(10))], 20)


def test_sliding_window_crossing_matches_reference(tiny0_dir, tiny0_ckpt):
    """A prompt longer than the window (40 > 16) and a decode that crosses it from inside
    (prompt 10, 14 new tokens) both match the fp32 reference tokens and logits in fp32."""
    from harness.reference.run import load_reference_model, reference_run

    model = load_reference_model(tiny0_dir)
    engine = _engine(tiny0_ckpt)
    for prompt, new in ((list(range(200, 240)), 6), (list(range(300, 310)), 14)):
        ref = reference_run(model, prompt, new)
        run = generate(engine, [prompt], new)[0]
        assert run.tokens == ref.generated
        assert rel_l2(run.step_logits, ref.step_logits) < FP32_ROUNDING


def test_multimodal_placeholder_ids_become_pad(tiny0_dir, tiny0_ckpt):
    """A prompt holding an image placeholder id computes what transformers' unified wrapper does
    (placeholder swapped for the pad id before embedding)."""
    from harness.reference.run import load_reference_model, reference_run

    spec = tiny0_ckpt.spec
    assert spec.placeholder_token_ids, "the tiny config is a unified config with placeholder ids"
    prompt = [5, 17, spec.placeholder_token_ids[0], 42, 99]
    ref = reference_run(load_reference_model(tiny0_dir), prompt, 0)
    got = _engine(tiny0_ckpt).prefill(prompt).logits
    assert rel_l2(got, ref.captures["logits"]) < FP32_ROUNDING


REAL_WINDOW = 1024  # the 12B's sliding window (docs/design.md#the-model-facts-and-traps)


@pytest.fixture(scope="module")
def real_window_ckpt(tmp_path_factory):
    """The tiny model with the 12B's real sliding window of 1024 keys."""
    import json

    from harness.inputs.checkpoint import Checkpoint

    from harness.inputs.tiny import TINY_CONFIG, build_tiny_checkpoint

    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"].update(sliding_window=REAL_WINDOW, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp("window1024")
    (out / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(build_tiny_checkpoint(out / "ckpt", seed=0, config_path=out / "config.json"))


@pytest.mark.slow  # an 1100-token prompt through transformers and the port twice
def test_real_sliding_window_is_reachable(real_window_ckpt, monkeypatch):
    """With docs/judging.md's configuration for the 12B's window (a bucket of 1280 in a 1296-slot cache)
    a 1100-token prompt reaches past position 1024, where a sliding query first loses key 0: the
    fp32 port equals transformers there, and a window one key too wide shows only past it."""
    from harness.reference.run import load_reference_model
    from tests.faults.catalog import window_one_too_wide

    prompt = [(7 * i) % 509 + 3 for i in range(1100)]
    with torch.no_grad():  # transformers' capped logits
        ref_logits = load_reference_model(real_window_ckpt.path)(input_ids=torch.tensor([prompt])).logits[0]

    def port_logits():
        engine = _engine(real_window_ckpt, buckets=(64, 1280), kv_len=1296)
        return engine.prefill(prompt).logits

    clean = port_logits()
    capped = torch.tanh(clean / 30.0) * 30.0
    assert rel_l2(capped, ref_logits) < FP32_ROUNDING
    window_one_too_wide(monkeypatch)
    wide = port_logits()
    before = rel_l2(wide[:REAL_WINDOW], clean[:REAL_WINDOW])
    after = rel_l2(wide[REAL_WINDOW:], clean[REAL_WINDOW:])
    assert before < FP32_ROUNDING < 1e-3 < after
