"""The CPU reference: its capture points are transformers' own hidden states, its raw logits are
the model's logits before the softcap, its residual points follow from the layer's submodules,
bf16 differs from fp32 by bf16 noise, the streaming mode reproduces the captures, and greedy
decode with the KV cache equals recomputing the whole sequence at every step."""

from __future__ import annotations

import pytest
import torch

from harness.reference.run import load_reference_model, text_model
from harness.reference.stream import stream_prefill_captures

CAP = 30.0  # final_logit_softcapping of the tiny config (and of the 12B)
NEW_TOKENS = 8  # what the tiny0_reference fixture decodes
LONG_PROMPT = 2  # 40 tokens: past the tiny model's sliding window of 16


@pytest.fixture(scope="module")
def model32(tiny0_dir):
    return load_reference_model(tiny0_dir, torch.float32)


@pytest.fixture(scope="module")
def hidden_states(model32, default_prompts):
    """transformers' own per-layer outputs and logits for each default prompt (no cache)."""
    outs = []
    with torch.no_grad():
        for prompt in default_prompts:
            out = model32(input_ids=torch.tensor([prompt]), output_hidden_states=True)
            outs.append((tuple(h[0] for h in out.hidden_states), out.logits[0]))
    return outs


def _ref32(tiny0_reference, k):
    return tiny0_reference["float32"][k]


@pytest.mark.parametrize("k", range(3))
def test_captures_equal_transformers_hidden_states(tiny0_reference, hidden_states, model32, k):
    """hidden_states[0] is the embedding output, hidden_states[i + 1] layer i's output for i < L-1,
    and the last entry is after the final norm: the captures equal each of them, and the final
    norm of the last layer's captured output."""
    captures = _ref32(tiny0_reference, k).captures
    states, _ = hidden_states[k]
    num_layers = model32.config.get_text_config().num_hidden_layers
    assert len(states) == num_layers + 1
    torch.testing.assert_close(captures["embeddings"], states[0])
    for i in range(num_layers - 1):
        torch.testing.assert_close(captures[f"layers.{i}.output"], states[i + 1], msg=f"layer {i}")
    torch.testing.assert_close(captures["final_norm"], states[num_layers])
    with torch.no_grad():
        renormed = text_model(model32).norm(captures[f"layers.{num_layers - 1}.output"])
    torch.testing.assert_close(captures["final_norm"], renormed)


@pytest.mark.parametrize("k", range(3))
def test_raw_logits_are_the_models_logits_before_the_cap(tiny0_reference, hidden_states, model32, k):
    """30 * tanh(raw / 30) equals the model's own (capped) logits, raw logits are the tied lm_head
    applied to the final norm, and they do exceed the cap (so raw really is pre-cap)."""
    captures = _ref32(tiny0_reference, k).captures
    _, model_logits = hidden_states[k]
    raw = captures["logits"]
    torch.testing.assert_close(CAP * torch.tanh(raw / CAP), model_logits)
    torch.testing.assert_close(captures["capped_logits"], model_logits)
    torch.testing.assert_close(raw, captures["final_norm"] @ model32.lm_head.weight.T)
    assert raw.abs().max() > CAP


def _window_mask(n: int, window: int | None) -> torch.Tensor:
    """Additive mask: query i sees key j when i - window < j <= i (plain causal without a window)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]


def _attn_residual(model32, index: int, x: torch.Tensor) -> torch.Tensor:
    """x + post_attention_layernorm(self_attn(input_layernorm(x))) from the layer's submodules, with
    the mask built here from the window rule."""
    lm = text_model(model32)
    layer = lm.layers[index]
    layer_type = model32.config.get_text_config().layer_types[index]
    window = layer.self_attn.sliding_window
    positions = torch.arange(x.shape[0])[None]
    cos_sin = lm.rotary_emb(x[None], positions, layer_type)
    attn, _ = layer.self_attn(layer.input_layernorm(x[None]), cos_sin, _window_mask(x.shape[0], window),
                              shared_kv_states={})
    return x + layer.post_attention_layernorm(attn)[0]


@pytest.mark.parametrize("index", [5, 8], ids=["full5", "sliding8"])
def test_residual_points_follow_from_the_layer(tiny0_reference, model32, index):
    """On the 40-token prompt (past the window): attn_residual is the layer input plus the normed
    attention output, mlp_residual adds the normed MLP of it, output is mlp_residual * layer_scalar."""
    captures = _ref32(tiny0_reference, LONG_PROMPT).captures
    layer = text_model(model32).layers[index]
    x = captures[f"layers.{index - 1}.output"]
    with torch.no_grad():
        attn_residual = _attn_residual(model32, index, x)
        mlp_residual = captures[f"layers.{index}.attn_residual"] + layer.post_feedforward_layernorm(
            layer.mlp(layer.pre_feedforward_layernorm(captures[f"layers.{index}.attn_residual"])))
    torch.testing.assert_close(captures[f"layers.{index}.attn_residual"], attn_residual, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(captures[f"layers.{index}.mlp_residual"], mlp_residual, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(captures[f"layers.{index}.output"],
                               captures[f"layers.{index}.mlp_residual"] * layer.layer_scalar)
    assert abs(float(layer.layer_scalar) - 1.0) >= 0.2  # the last check can tell a dropped scalar


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_bf16_reference_differs_from_fp32_by_bf16_noise(tiny0_reference):
    """Every capture point of the bf16 run differs from fp32 by more than zero and by less than 10%
    relative L2 (bf16 keeps 8 significant bits: one rounding is ~0.4%, twelve layers compound it,
    and the logits, a difference of large dot products, carry it relative to their smaller size)."""
    for r32, r16 in zip(tiny0_reference["float32"], tiny0_reference["bfloat16"]):
        assert r16.dtype == "bfloat16" and r32.dtype == "float32"
        assert r16.captures.keys() == r32.captures.keys()
        errors = {name: _rel_l2(r16.captures[name], r32.captures[name]) for name in r32.captures}
        assert min(errors.values()) > 0, min(errors, key=errors.get)
        assert max(errors.values()) < 0.10, max(errors.items(), key=lambda kv: kv[1])


def test_streaming_captures_equal_the_full_model(tiny0_ckpt, tiny0_reference, default_prompts):
    """Layer-at-a-time prefill reproduces every capture of the whole-model run to fp32 rounding,
    on the prompt that crosses the sliding window."""
    captures = _ref32(tiny0_reference, LONG_PROMPT).captures
    streamed = stream_prefill_captures(tiny0_ckpt, default_prompts[LONG_PROMPT], torch.float32)
    # the whole-model run also has the decode steps' points, its cache writes and capped step logits
    prefill = {k: v for k, v in captures.items() if not k.startswith(("decode.", "kv.", "step_"))}
    assert streamed.keys() == prefill.keys()
    for name, tensor in prefill.items():
        torch.testing.assert_close(streamed[name], tensor, msg=name)


def _greedy_by_recompute(model, prompt: list[int], new_tokens: int):
    """Greedy decode that re-runs the whole sequence at every step: no cache to get wrong."""
    ids, tokens, logits = list(prompt), [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            step = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            logits.append(step)
            tokens.append(int(step.argmax()))
            ids.append(tokens[-1])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("k", range(3))
def test_cached_greedy_decode_equals_full_recompute(tiny0_reference, model32, default_prompts, k):
    """The reference's greedy tokens (transformers KV cache) equal a loop that recomputes the whole
    sequence each step, and its step logits, capped, equal the recomputed ones."""
    ref = _ref32(tiny0_reference, k)
    tokens, capped = _greedy_by_recompute(model32, default_prompts[k], NEW_TOKENS)
    assert ref.generated == tokens
    # The cached and recomputed paths sum in different orders: fp32 rounding of logits up to ~|70|
    # (eps 1.2e-7 times the magnitude, compounded over 12 layers) stays well under 1e-4.
    torch.testing.assert_close(CAP * torch.tanh(ref.step_logits / CAP), capped, rtol=1e-5, atol=1e-4)


def test_decode_captures_and_cache_writes_line_up(tiny0_reference, default_prompts):
    """Every decode step the model runs has every capture point (one row per step), the recorded
    cache writes hold one row per written position, and the prefill rows of the cache are the keys
    and values of the prompt positions (the last decode step is never run: its token is only chosen)."""
    ref = _ref32(tiny0_reference, 2)
    n, steps = len(ref.prompt), len(ref.generated)
    assert ref.captures["decode.embeddings"].shape[0] == steps - 1
    assert ref.captures["decode.layers.11.output"].shape[0] == steps - 1
    assert ref.captures["step_capped_logits"].shape == ref.step_logits.shape
    assert torch.equal(ref.captures["step_capped_logits"].argmax(-1), torch.tensor(ref.generated))
    assert ref.captures["kv.0.k"].shape[0] == n + steps - 1 == ref.captures["kv.5.v"].shape[0]
    # the decode step's raw logits are the next step's logits that chose its token
    torch.testing.assert_close(ref.captures["decode.logits"], ref.step_logits[1:])
