"""The judge's calibration numbers pinned with literal values on synthetic tensors: a loosened
constant (envelope factor, fp32 factor, near-tie factor, probability tolerances, the saturation
exemption, the worst-position check) fails here in seconds, not only in the slow fault catalog.
No expected value here is computed from an imported constant."""

from __future__ import annotations

import math

import pytest
import torch

from harness.judge.compare import BF16, FP32, compare_point, compare_probabilities, per_position_rel_l2
from harness.judge.tokens import compare_logits, saturation_tie

ROWS, WIDTH = 4, 8
A = 0.01  # the envelope's relative error per affected row: far above the bf16 floor (2^-9)


def _ref() -> torch.Tensor:
    return torch.ones(ROWS, WIDTH, dtype=torch.float64)  # every row of norm sqrt(8)


def _with_row_errors(per_row: list[float]) -> torch.Tensor:
    """The reference plus, in each row, an error of the given relative size (along lane 0)."""
    out = _ref()
    out[:, 0] += torch.tensor(per_row, dtype=torch.float64) * math.sqrt(WIDTH)
    return out


def _whole(b: float):
    """Envelope error A in row 0 only (whole-tensor relative error A/2, worst row A); device error b
    in every row (whole b, worst row b): whole ratio 2b/A, worst-position ratio b/A."""
    return _with_row_errors([b] * ROWS), _with_row_errors([A, 0, 0, 0])


def _worst(c: float):
    """Envelope error A in every row (whole A, worst row A); device error c in row 2 only (whole c/2,
    worst row c): whole ratio c/(2A), worst-position ratio c/A."""
    return _with_row_errors([0, 0, c, 0]), _with_row_errors([A] * ROWS)


def test_whole_tensor_at_5x_the_envelope_fails_and_at_3x_passes():
    dev, env = _whole(2.5 * A)
    fail = compare_point("p", dev, _ref(), env)
    dev, env = _whole(1.5 * A)
    ok = compare_point("p", dev, _ref(), env)
    assert fail.ratio == pytest.approx(5.0, rel=1e-3) and fail.position_ratio == pytest.approx(2.5, rel=1e-3)
    assert not fail.passed
    assert ok.ratio == pytest.approx(3.0, rel=1e-3) and ok.passed


def test_worst_position_at_5x_the_envelope_fails_and_at_3x_passes():
    dev, env = _worst(5 * A)
    fail = compare_point("p", dev, _ref(), env)
    assert fail.position_ratio == pytest.approx(5.0, rel=1e-3) and fail.ratio == pytest.approx(2.5, rel=1e-3)
    assert not fail.passed and fail.worst_position == 2
    dev, env = _worst(3 * A)
    ok = compare_point("p", dev, _ref(), env)
    assert ok.position_ratio == pytest.approx(3.0, rel=1e-3) and ok.passed


def test_fp32_stage_fails_at_9x_the_float64_measured_envelope_and_passes_at_7x():
    """The fp32 judge: the fp32 reference's own error against float64 (unscaled), factor 8, whole
    tensor and worst position."""
    e = 1e-6  # far above one fp32 rounding
    for c, passed in ((7.0, True), (9.0, False)):
        result = compare_point("p", _with_row_errors([0, 0, c * e, 0]), _ref(), _with_row_errors([e] * ROWS), FP32)
        assert result.envelope_rel_l2 == pytest.approx(e, rel=1e-3)
        assert result.position_ratio == pytest.approx(c, rel=1e-3) and result.passed is passed
        result = compare_point("p", _with_row_errors([c / 2 * e] * ROWS), _ref(), _with_row_errors([e, 0, 0, 0]), FP32)
        assert result.ratio == pytest.approx(c, rel=1e-3) and result.passed is passed


def test_fp32_envelope_floor_is_one_fp32_rounding():
    """An fp32 envelope of 0 (the float64 reference rounds to the fp32 one) is floored at 2^-24:
    an error of 7 x 2^-24 passes, 9x fails."""
    for k, passed in ((7.0, True), (9.0, False)):
        result = compare_point("p", _with_row_errors([k * 2.0 ** -24] * ROWS), _ref(), _ref(), FP32)
        assert result.envelope_rel_l2 == 2.0 ** -24 and result.passed is passed


def test_per_layer_input_is_judged_by_its_pooled_envelope():
    """The median over >= 3 layers of one part's envelope floors each layer's (whole and worst
    position); fewer layers pool nothing."""
    from harness.judge.compare import pooled_floors

    names = [f"layers.{i}.per_layer_input" for i in range(3)]
    env = {n: _with_row_errors([k * A] * ROWS) for n, k in zip(names, (1, 2, 3))}
    ref = {n: _ref() for n in names}
    whole, worst = pooled_floors(names, ref, env)
    assert whole == pytest.approx(2 * A, rel=1e-3) and worst == pytest.approx(2 * A, rel=1e-3)
    assert pooled_floors(names[:2], ref, env) == (0.0, 0.0)
    dev = _with_row_errors([7 * A] * ROWS)  # 7x layer 0's own envelope, 3.5x the pooled one
    assert not compare_point(names[0], dev, _ref(), env[names[0]]).passed
    assert compare_point(names[0], dev, _ref(), env[names[0]], pooled=(whole, worst)).passed
    assert not compare_point(names[0], _with_row_errors([9 * A] * ROWS), _ref(), env[names[0]],
                             pooled=(whole, worst)).passed


def test_envelope_floor_is_one_bf16_rounding():
    """An envelope of 0 is floored at 2^-9 (bf16 unit roundoff): an error of 3 x 2^-9 passes, 5x fails."""
    ref = _ref()
    for k, passed in ((3.0, True), (5.0, False)):
        dev = _with_row_errors([k * 2.0 ** -9] * ROWS)
        assert compare_point("p", dev, ref, ref.clone()).passed is passed


# ---- tokens ------------------------------------------------------------------------------------------

def test_sub_ulp_unsaturated_flip_is_a_mismatch():
    """Capped values 0.01 apart (well under one bf16 ULP, 0.0625 at 8.8) but not equal: the
    saturation exemption does not apply, the flip is listed (as a near tie)."""
    cap = 30.0
    ref = torch.tensor([[10.0, 9.99, 0.0, -5.0]])
    capped = torch.tanh(ref / cap) * cap
    assert 0.0 < float(capped[0, 0] - capped[0, 1]) < 0.0625
    assert not saturation_tie(capped[0], 1)
    device = torch.tensor([[9.99, 10.0, 0.0, -5.0]])
    result = compare_logits(device, ref, None, cap, band=1.0)
    assert [(m.position, m.device_token, m.kind) for m in result.mismatches] == [(0, 1, "near_tie")]


def test_saturation_exemption_only_for_exactly_equal_capped_maxima():
    row = torch.tensor([30.0, 30.0, 29.999998, 0.0])  # capped values; the third one fp32 ULP below
    assert saturation_tie(row, 1)
    assert not saturation_tie(row, 2)


def test_near_tie_floor_is_four_bf16_ulps():
    """With a zero band, a flip at |logit| 20 (bf16 ULP 0.125) is a tie up to 0.5 and not at 0.6."""
    from harness.judge.tokens import classify_mismatch

    assert classify_mismatch(0, torch.tensor([20.0, 19.5]), 1).kind == "near_tie"
    assert classify_mismatch(0, torch.tensor([20.0, 19.4]), 1).kind == "divergence"


# ---- probabilities -------------------------------------------------------------------------------------

def _tail_shift(ref_p: torch.Tensor, factor: float) -> torch.Tensor:
    """q: ref_p with mass moved between two halves of the tail (outside the top 5), the top 5 and
    the tail's total untouched: a KL with no top-k mass error."""
    q = ref_p.clone()
    tail = ref_p.argsort(descending=True)[5:]
    a, b = tail[::2], tail[1::2]
    ma, mb = float(ref_p[a].sum()), float(ref_p[b].sum())
    q[a] *= factor
    q[b] *= (ma + mb - factor * ma) / mb
    return q


def _tail_kl(ref_p: torch.Tensor, target: float) -> torch.Tensor:
    """Host probabilities at KL(ref || q) = target (bisection on the tail shift)."""
    lo, hi = 1.0, 1.9
    for _ in range(80):
        mid = (lo + hi) / 2
        q = _tail_shift(ref_p, mid)
        kl = float((ref_p * (ref_p.log() - q.log())).sum())
        lo, hi = (mid, hi) if kl < target else (lo, mid)
    return _tail_shift(ref_p, (lo + hi) / 2)


def _scaled_row(p: torch.Tensor, rel: float) -> torch.Tensor:
    """p with its largest probability off by the relative error `rel` and the rest renormalised
    (a total variation of about rel * max p)."""
    q = p.clone()
    top = int(q.argmax())
    q[top] *= 1 + rel
    rest = torch.ones_like(q, dtype=torch.bool)
    rest[top] = False
    q[rest] *= (1 - float(q[top])) / float(q[rest].sum())
    return q


@pytest.mark.parametrize("rel, passed", [(0.5e-4, True), (1.4e-4, False), (4e-4, False)])
def test_host_relative_error_tolerance_is_1e_4(rel, passed):
    """Every row's largest relative probability error within 1e-4 (the total variation stays below
    its own tolerance here: the top probability is about 0.09)."""
    capped = torch.linspace(3.0, -3.0, 64, dtype=torch.float64)[None]
    q = _scaled_row(torch.softmax(capped[0], -1), rel)[None]
    result = compare_probabilities("p", q, capped)
    assert result.relative_error_max == pytest.approx(rel, rel=1e-6)
    assert result.total_variation_max < 5e-5
    assert result.passed is passed


@pytest.mark.parametrize("tv, passed", [(2.5e-5, True), (7e-5, False)])
def test_host_total_variation_tolerance_is_5e_5(tv, passed):
    """Mass moved into probabilities below the 1e-30 floor (no relative error judged there): the
    total variation catches it at 5e-5."""
    capped = torch.zeros(1, 4, dtype=torch.float64)
    capped[0, 3] = -200.0  # p ~ 1e-87: below the floor
    p = torch.softmax(capped, -1)
    q = p.clone()
    q[0, :3] *= 1 - tv
    q[0, 3] = tv
    result = compare_probabilities("p", q, capped)
    assert result.total_variation_max == pytest.approx(tv, rel=1e-6)
    assert result.passed is passed


@pytest.mark.parametrize("vocab", [512, 262144])
def test_host_tolerances_hold_fp32_softmax_with_room(vocab):
    """The measurement behind the tolerances: the engine's fp32 softcap + softmax of logits of any
    scale against the float64 softmax of transformers' fp32 capped logits stays below an eighth of
    both tolerances (measured: 1.2e-5 and 5.7e-6 at 262144, the 12B's vocabulary)."""
    from harness.base.numerics import softcap
    from harness.reference.run import transformers_capped

    gen = torch.Generator().manual_seed(0)
    for scale in (0.01, 1.0, 3.0, 10.0, 1000.0):
        raw = scale * torch.randn(4, vocab, generator=gen)
        result = compare_probabilities("p", torch.softmax(softcap(raw, 30.0), -1), transformers_capped(raw, 30.0))
        assert result.passed and result.ratio < 0.5, (scale, result.explain())


def test_host_transform_faults_fail_at_one_row():
    """One row (a 1-token prompt) of a tiny model's nearly flat logits: a softcap without the
    division, an uncapped softmax and a temperature of 0.999 each fail."""
    from harness.reference.run import transformers_capped

    raw = 0.2 * torch.randn(1, 512, generator=torch.Generator().manual_seed(1))
    expected = transformers_capped(raw, 30.0)
    assert compare_probabilities("p", torch.softmax(30.0 * torch.tanh(raw / 30.0), -1), expected).passed
    for served in (torch.softmax(30.0 * torch.tanh(raw), -1), torch.softmax(raw, -1),
                   torch.softmax(30.0 * torch.tanh(raw / 30.0) / 0.999, -1)):
        assert not compare_probabilities("p", served, expected).passed


def test_stage_settings_are_pinned():
    assert (BF16.factor, BF16.floor, BF16.envelope_ties) == (4.0, 2.0 ** -9, True)
    assert (FP32.factor, FP32.floor, FP32.envelope_ties) == (8.0, 2.0 ** -24, False)


def test_a_row_is_measured_against_at_least_one_percent_of_the_median_row_norm():
    """per_position_rel_l2: a row whose own norm is tiny is measured against 1% of the point's
    median row norm (a gated point's near-zero rows), never more: a loosened floor hides real
    per-row errors of ordinary rows."""
    ref = torch.ones(5, 4)  # row norms 2.0; median 2.0 -> floor 0.02
    ref[0] = 0.001  # row norm 0.002, under the floor
    dev = ref.clone()
    dev[0] += 0.005  # error norm 0.01: against the floor 0.02 -> 0.5 (its own norm would give 5.0)
    dev[1] += 0.1  # error norm 0.2 on an ordinary row: 0.2 / 2.0 = 0.1
    got = per_position_rel_l2(dev, ref)
    assert got[0].item() == pytest.approx(0.5, rel=1e-6)
    assert got[1].item() == pytest.approx(0.1, rel=1e-6)
    assert got[2:].abs().max().item() == 0.0
