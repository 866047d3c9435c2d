"""The host softcap 30 * tanh(x / 30) (docs/design.md#the-port): what greedy decode on raw logits may
and may not assume, where fp32 and bf16 saturate, and equality with transformers' own softcap.

Softcap is monotone non-decreasing but not strictly increasing in floating point, so the invariant
is "the raw argmax is among the capped maxima", not "the argmax index is identical".
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harness import FIXTURES_DIR
from harness.port import engine
from harness.reference.run import load_reference_model, text_model
from tests.strategies import logit_vectors, realistic_logit_rows, saturating_logit, vocab_logits

# The 12B's final_logit_softcapping, read from its released config rather than restated.
CAP = float(json.loads((FIXTURES_DIR / "configs" / "gemma-4-12b-it.json").read_text())
            ["text_config"]["final_logit_softcapping"])
# The fp32 number right after 100.0 (math.nextafter would step in float64 and round back to 100).
NEXT_FP32_AFTER_100 = float(np.nextafter(np.float32(100.0), np.float32(np.inf)))
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
DTYPES = [torch.float32, torch.bfloat16]
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # relative error of one round-to-nearest with 8 significant bits


def transformers_bf16_softcap(logits: torch.Tensor) -> torch.Tensor:
    """What transformers computes on bf16 logits: logits / cap, tanh, * cap, each rounded to bf16
    (Gemma4UnifiedForConditionalGeneration.forward)."""
    return torch.tanh(logits / CAP) * CAP


def capped_versions(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The host's fp32 softcap, and for bf16 logits also transformers' bf16 one."""
    versions = {"host fp32 softcap": engine.softcap(raw, CAP)}
    if raw.dtype == torch.bfloat16:
        versions["transformers bf16 softcap"] = transformers_bf16_softcap(raw)
    return versions


def as_logits(row: torch.Tensor, dtype) -> torch.Tensor:
    """fp32 logits in `dtype`; fp32 values past bf16's range clamp to its max instead of inf."""
    finfo = torch.finfo(dtype)
    return torch.nan_to_num(row.to(dtype), posinf=finfo.max, neginf=finfo.min)


def assert_raw_argmax_among_capped_maxima(raw: torch.Tensor) -> None:
    """(a) capped[argmax(raw)] == max(capped); (b) if that maximum is unique, argmaxes agree."""
    chosen = int(raw.argmax())
    for name, capped in capped_versions(raw).items():
        top = capped.max()
        assert capped[chosen] == top, f"{name}: raw argmax {chosen} caps to {capped[chosen]}, max {top}"
        if int((capped == top).sum()) == 1:
            assert int(capped.argmax()) == chosen, name


# ---- (a), (b): properties over arbitrary finite logits -------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@given(values=logit_vectors(torch.float32))
@example(values=[280.0, 300.0]).via("both saturate in fp32 and bf16")
@example(values=[100.0, NEXT_FP32_AFTER_100]).via("adjacent fp32 logits cap to one value")
@example(values=[103.5, 104.0, 110.0]).via("bf16 saturation edge")
@example(values=[-3e38, 3e38, 3e38]).via("huge ties")
@example(values=[5.0, 5.0, -5.0]).via("plain tie")
def test_raw_argmax_is_among_capped_maxima(dtype, values):
    """For any finite logits, the raw argmax is among the capped maxima (softcap is monotone
    non-decreasing), and where the capped maximum is unique its index is the raw argmax."""
    assert_raw_argmax_among_capped_maxima(as_logits(torch.tensor(values, dtype=torch.float32), dtype))


@given(values=logit_vectors(torch.bfloat16))
def test_raw_argmax_is_among_capped_maxima_bf16_native(values):
    """The same property for logits drawn within bf16's range (no overflow on the cast)."""
    assert_raw_argmax_among_capped_maxima(torch.tensor(values, dtype=torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@settings(max_examples=20)  # each example is a 262144-wide row: a few suffice for the wide path
@given(row=vocab_logits(torch.float32))
def test_raw_argmax_is_among_capped_maxima_at_vocab_size(dtype, row):
    """The property holds over whole 262144-wide vocabulary rows (vectorized tanh, tail elements)."""
    assert_raw_argmax_among_capped_maxima(as_logits(row, dtype))


# ---- (a'): realistic logits (|x| <= 100): the formula itself, not just its monotonicity -----------
# The properties above hold for any non-decreasing function (a clamp, cap * tanh(x), the identity).
# In the range real logits live in, the host softcap must be 30 * tanh(x / 30) to fp32 rounding and
# strictly increasing: the raw and capped argmax are then the same index.

FP32_ULP_AT_CAP = 2.0 ** -19  # fp32 spacing at 16..32


@given(values=realistic_logit_rows())
def test_host_softcap_is_the_formula_on_realistic_logits(values):
    raw = torch.tensor(values, dtype=torch.float32)
    exact = CAP * torch.tanh(raw.double() / CAP)
    assert bool(((engine.softcap(raw, CAP).double() - exact).abs() <= 2 * FP32_ULP_AT_CAP).all())


@given(values=realistic_logit_rows())
def test_realistic_logits_keep_their_order_and_argmax(values):
    """Below saturation distinct logits 1e-3 apart stay distinct and ordered after the cap (the
    slope sech^2(100/30) > 5e-3 turns 1e-3 into > 2 fp32 ULPs at 30), so argmax is unchanged."""
    raw = torch.tensor(values, dtype=torch.float32)
    capped = engine.softcap(raw, CAP)
    order = raw.argsort()
    gaps, capped_gaps = raw[order].diff(), capped[order].diff()
    assert bool((capped_gaps[gaps >= 1e-3] > 0).all())
    top2 = raw.topk(2).values
    if float(top2[0] - top2[1]) >= 1e-3:
        assert int(capped.argmax()) == int(raw.argmax())


# ---- (a''): the saturation regime as its own property --------------------------------------------

@given(values=st.lists(saturating_logit(271.0), min_size=1, max_size=16))
def test_fp32_softcap_saturates_to_exactly_the_cap(values):
    """Every fp32 logit at or past ~270.3 caps to exactly +-30.0: there, only "the raw argmax is
    among the capped maxima" holds."""
    raw = torch.tensor(values, dtype=torch.float32)
    capped = engine.softcap(raw, CAP)
    assert bool((capped.abs() == CAP).all())
    assert bool((capped.sign() == raw.sign()).all())
    assert_raw_argmax_among_capped_maxima(raw)


@given(values=st.lists(saturating_logit(105.0, float(torch.finfo(torch.bfloat16).max)), min_size=1, max_size=16))
def test_bf16_softcap_in_bf16_saturates_to_exactly_the_cap(values):
    raw = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
    assert bool((transformers_bf16_softcap(raw).abs() == CAP).all())
    assert_raw_argmax_among_capped_maxima(raw)


# ---- (c): the saturation regime, found by computation --------------------------------------------

def _from_bits(bits: int, dtype) -> torch.Tensor:
    return torch.tensor([bits], dtype=INT_VIEW[dtype]).view(dtype)


def _bits(value: float, dtype) -> int:
    return int(torch.tensor([value], dtype=dtype).view(INT_VIEW[dtype]))


def first_saturating(cap_fn, dtype, low: float, high: float) -> float:
    """The smallest `dtype` value x in (low, high] with cap_fn(x) == CAP exactly, by bisection over
    bit patterns (positive floats order as their bits); cap_fn must be non-decreasing there."""
    lo, hi = _bits(low, dtype), _bits(high, dtype)
    assert cap_fn(_from_bits(lo, dtype)).item() < CAP and cap_fn(_from_bits(hi, dtype)).item() == CAP
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cap_fn(_from_bits(mid, dtype)).item() == CAP:
            hi = mid
        else:
            lo = mid
    return _from_bits(hi, dtype).item()


def _all_floats(dtype, low: float, high: float) -> torch.Tensor:
    """Every `dtype` value in [low, high), in increasing order."""
    return torch.arange(_bits(low, dtype), _bits(high, dtype), dtype=INT_VIEW[dtype]).view(dtype)


def fp32_softcap(x):
    return engine.softcap(x, CAP)


def test_fp32_softcap_saturates_to_exactly_the_cap_near_270():
    """In fp32, 30 * tanh(x / 30) == 30.0 exactly from x ~ 270.3 on (docs/design.md#the-port: "about 270"):
    tanh(y) rounds to 1 once 1 - tanh(y) ~ 2 exp(-2y) is below half an fp32 ulp under 1 (2^-25),
    y > 13 ln 2. Checked exhaustively over every fp32 in [256, 512): non-decreasing, below the cap
    before the bisected point and exactly the cap from it on (vectorized tanh included)."""
    x = first_saturating(fp32_softcap, torch.float32, 1.0, 1e4)
    assert abs(x - 270.5) < 0.5
    assert abs(x - CAP * 13 * math.log(2)) < 0.05
    grid = _all_floats(torch.float32, 256.0, 512.0)
    capped = fp32_softcap(grid)
    assert bool((capped[1:] >= capped[:-1]).all())
    first = int((capped == CAP).nonzero()[0])
    assert grid[first].item() == x and bool((capped[first:] == CAP).all())


def test_bf16_softcap_in_bf16_saturates_near_104():
    """Computed as transformers does in bf16 (/30, tanh, *30, each rounded to bf16), softcap equals
    30.0 exactly from x ~ 104 on: bf16's half ulp under 1 is 2^-9, y > 5 ln 2. The bisection agrees
    with an exhaustive scan of every positive finite bf16, which is non-decreasing throughout. The
    host's fp32 softcap of the same bf16 logit is still below the cap there."""
    x = first_saturating(transformers_bf16_softcap, torch.bfloat16, 1.0, 1e4)
    assert abs(x - 104.0) <= 1.0
    every = _all_floats(torch.bfloat16, 0.0, float(torch.finfo(torch.bfloat16).max))
    capped = transformers_bf16_softcap(every)
    assert bool((capped[1:] >= capped[:-1]).all())
    first = int((capped == CAP).nonzero()[0])
    assert every[first].item() == x and bool((capped[first:] == CAP).all())
    assert engine.softcap(torch.tensor([x], dtype=torch.bfloat16), CAP).item() < CAP


# ---- (d): where the naive claim "same argmax index" breaks ---------------------------------------

@pytest.mark.parametrize("raw, cap_fn, why", [
    (torch.tensor([280.0, 300.0]), fp32_softcap, "both above the fp32 saturation point"),
    (torch.tensor([100.0, NEXT_FP32_AFTER_100]), fp32_softcap,
     "adjacent fp32 logits round to one capped value, far below saturation"),
    (torch.tensor([105.0, 110.0], dtype=torch.bfloat16), transformers_bf16_softcap,
     "both above the bf16 saturation point"),
], ids=["fp32-saturated", "fp32-rounding", "bf16-saturated"])
def test_naive_argmax_claim_breaks_but_raw_argmax_stays_among_maxima(raw, cap_fn, why):
    """Where softcap maps a smaller raw logit at a lower index to the same value as the raw maximum,
    the capped argmax (first maximal index) is not the raw argmax: the naive claim fails while
    "the raw argmax is among the capped maxima" holds."""
    capped = cap_fn(raw)
    assert capped[0] == capped[1], why
    assert int(raw.argmax()) == 1 and int(capped.argmax()) == 0  # the naive claim is false here
    assert capped[int(raw.argmax())] == capped.max()


def test_naive_argmax_claim_breaks_at_vocab_size():
    """A 262144-wide row whose raw maximum (300, the last token) and a lower logit (280, token 0)
    both saturate: greedy on capped logits picks token 0, greedy on raw logits the last token."""
    raw = torch.zeros(262144)
    raw[0], raw[-1] = 280.0, 300.0
    capped = fp32_softcap(raw)
    assert int(raw.argmax()) == raw.numel() - 1 and int(capped.argmax()) == 0
    assert capped[-1] == capped.max()


def test_saturation_examples_sit_above_the_computed_saturation_points():
    """The explicit examples above are in the saturated regime by computation, not by assumption."""
    assert 280.0 >= first_saturating(fp32_softcap, torch.float32, 1.0, 1e4)
    assert 105.0 >= first_saturating(transformers_bf16_softcap, torch.bfloat16, 1.0, 1e4)


# ---- (e): the host softcap is transformers' softcap ----------------------------------------------

def _raw_and_capped(checkpoint_dir, dtype, prompt, norm_gain):
    """transformers' raw lm_head logits (hooked) and its capped output logits for `prompt`.
    norm_gain scales the final norm weight so the logits can reach the saturating regime."""
    model = load_reference_model(checkpoint_dir, dtype)
    with torch.no_grad():
        text_model(model).norm.weight.mul_(norm_gain)
    raw = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: raw.append(out.detach()))
    try:
        with torch.no_grad():
            capped = model(input_ids=torch.tensor([prompt])).logits
    finally:
        hook.remove()
    return raw[0][0], capped[0]


@pytest.mark.parametrize("norm_gain", [1.0, 5.0], ids=["as-built", "saturating"])
def test_host_softcap_equals_transformers_in_fp32(tiny0_dir, default_prompts, norm_gain):
    """In fp32 softcap(raw lm_head logits) equals transformers' output logits exactly, including
    logits pushed past the saturation point (the final norm scaled up 5x)."""
    raw, capped = _raw_and_capped(tiny0_dir, torch.float32, default_prompts[0], norm_gain)
    assert raw.dtype == capped.dtype == torch.float32
    if norm_gain > 1:
        assert bool((raw.abs() > 270.5).any())
    assert torch.equal(engine.softcap(raw, CAP), capped)


@pytest.mark.parametrize("norm_gain", [1.0, 5.0], ids=["as-built", "saturating"])
def test_host_softcap_formula_in_bf16_equals_transformers_bf16(tiny0_dir, default_prompts, norm_gain):
    """In bf16, the host formula computed in bf16 equals transformers' bf16 logits exactly; the
    host's fp32 softcap of the same bf16 raw logits is within the three bf16 roundings of
    transformers' path (x/30, tanh, *30: each within bf16's unit roundoff 2^-8 relative, and
    |y sech^2 y| <= tanh y keeps the first one's effect below tanh's own), so <= 3 * 2^-8 * |c|."""
    raw, capped = _raw_and_capped(tiny0_dir, torch.bfloat16, default_prompts[0], norm_gain)
    assert raw.dtype == capped.dtype == torch.bfloat16
    if norm_gain > 1:
        assert bool((raw.abs() > 104).any())
    assert torch.equal(CAP * torch.tanh(raw / CAP), capped)
    host = engine.softcap(raw, CAP)
    bound = 3 * BF16_UNIT_ROUNDOFF * host.abs()
    assert bool(((host - capped.float()).abs() <= bound).all())
