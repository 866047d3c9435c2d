"""The judge: the one tolerance policy used by the suites, `check` and `bisect`.

Every calibration number lives here (docs/judging.md cites them). One settings object per stage
(`BF16`: the envelope stage, `FP32`: the structural stage), one point judge (`compare_point`) and
the host probabilities' judge (`compare_probabilities`); the tokens' judge (the band calibration,
the tie helper, the flip and departure classifiers, the logits' verdict) is harness/judge/tokens.py:
every command judges what harness.parity.observe observed with these.

The port (bf16 on the device) is judged against the CPU fp32 reference by the error that the same
computation in bf16 on CPU already has at the same point: its noise envelope (docs/judging.md). A fixed
atol/rtol at bf16 either fails healthy ports or hides broken ones; a ratio to the envelope does
neither, and it carries over to checkpoints and configs the harness has never seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.judge.ratios import position_r
from harness.judge.verdicts import PointResult, ProbabilityResult

# A point passes while its error is at most this multiple of the bf16 envelope. Where from: two
# bf16 computations that differ only in summation order (TP=2 partial sums reduced in fp32 vs one
# rank) carry rounding errors of the same size, so a healthy port sits near ratio 1 (measured on
# the tiny fixtures across seeds: at most ~1.6, tests/parity prints it); every fault in
# tests/faults lands at 10x or more. 4 leaves room for accumulation order without hiding a bug.
ENVELOPE_FACTOR = 4.0
# Envelope floor: bf16's unit roundoff 2^-9. A point whose bf16 envelope is smaller than one
# rounding (the embedding lookup, exact in both dtypes for some inputs) is judged against this.
ENVELOPE_FLOOR = 2.0 ** -9
# Per-position relative errors divide by at least this fraction of the point's median row norm
# (per_position_rel_l2). On the tiny E2B a gated per-layer-input row at 5e-4 of the median turned a
# healthy bf16 port into a 6x per-position ratio; 1% keeps such rows judged on a meaningful scale.
ROW_NORM_FLOOR = 1e-2
# The family's gated per-layer input (8 to 256 lanes a row; its noise is the gate's, not carried from
# layer to layer) is judged by at least the median over its layers of the envelope's whole-tensor and
# worst-position errors. Where from: at one row a narrow point's envelope is a single draw of a
# heavy-tailed quantity (8 lanes on the tiny E4B): the census (tests/census) saw a healthy bf16
# port at 4.7x one layer's envelope at a 1-token prompt and 5.5x at prompts of 3 and 8 tokens while
# the neighbouring layers' envelopes were 2-3x larger; the median of POOLED_MIN_LAYERS or more
# draws holds at one row. The residual stream's points are not pooled (their noise grows with depth).
# Its rows' errors are measured against at least the point's median row norm (an absolute error at
# the point's scale): a healthy row at 0.28 of the median norm measured 0.27 relative error against
# an envelope of 0.05 at its worst row (the census, tiny E4B, prompts of 3 and 8 tokens).
POOLED_PARTS = ("per_layer_input",)
POOLED_MIN_LAYERS = 3
# A choice that departs from the reference (a token, an MoE router's experts) is decided on the
# port's own path where the stage has it (tokens.own_path_choice): transformers' own head or router
# alone, in fp32 and bf16, fed the very input the port had. The same choice passes; a different one
# passes only while its fp32 margin there is within DECISION_HEADROOM x what bf16 moved that very
# margin on that input (one draw of the noise of one decision: the port's own rounding is another
# draw of the same size, as for ENVELOPE_FACTOR), at least NEAR_TIE_ULPS bf16 ULPs.
DECISION_HEADROOM = 4.0
# Where no own path is at hand (the served build, whose graph returns no layer outputs; a replayed
# host step; the drafter's clusters; quality's corpus), a mismatch is a near tie when the
# reference's margin is inside the tail band: NEAR_TIE_FACTOR x the largest (NEAR_TIE_QUANTILE 1)
# move bf16 makes of the margin between the fp32 top-1 and each of its next NEAR_TIE_COMPETITORS, over
# every position and prompt (prefill rows and decode steps), from the references alone. Where
# from: a quantile misses the heavy tail sharp attention gives (issue 45: on transformers' own tester
# configuration bf16 moved one margin by 0.472 where 2 x the 0.99 quantile was 0.198; a trained
# model is sharper); the largest move, with 1.5x headroom for the port's own draw, holds on the tail. A flip
# the fp32 stage also shows is never a near tie.
NEAR_TIE_QUANTILE = 1.0
NEAR_TIE_FACTOR = 1.5
NEAR_TIE_COMPETITORS = 4
# The band never drops below this many bf16 ULPs at the row's largest magnitude (a few ULPs: at
# 18 a bf16 ULP is 0.125): two logits one rounding apart can always swap. One ULP basis for every
# tie (tie_threshold: tokens, routers, served), the row's largest |value|: each is an output of
# one bf16 matmul, whose rounding scales with the row (docs/design.md#one-home-for-each-decision).
NEAR_TIE_ULPS = 4
# MoE routing: decided on the port's own path in the bf16 stage and the local verdicts (transformers'
# router alone on the port's router input, tokens.own_path_choice); where no own path is at hand, a
# router choice off the fp32 top-k is a near tie within the tail band: ROUTING_FACTOR x the largest
# (ROUTING_QUANTILE 1) move bf16 makes of the top-k boundary margin, never below NEAR_TIE_ULPS ULPs.
ROUTING_QUANTILE = 1.0
ROUTING_FACTOR = 1.5
# PLE models (harness/parity/forced_path.py add_pins): a gated per-layer input row whose expected
# bf16 error (the point's median relative error x its median row norm / the row's norm) is at least
# PLE_PIN_NOISE of the row has no direction at bf16 precision, and the layer's post-norm scales that
# direction up to full size: the references take the port's row there (teacher-forced, as tokens
# and routing are). Measured on the tiny E2B/E4B shapes: the bf16 reference's relative error at
# these points has median 0.017 and 0.99 quantile 0.15-0.21; each false alarm seen came from a row
# 60x-5000x below the median norm. Forcing changes the path, so such rows are looked for again,
# at most FORCING_PASSES times.
PLE_PIN_NOISE = 0.25
FORCING_PASSES = 3
# The fp32 structural stage: the port in fp32 must equal the fp32 reference to fp32 precision. Its
# envelope is measured, not scaled from bf16: at every point the fp32 reference's own error against
# transformers in float64 along the same path (harness/reference/float64.py), whole tensor and per
# position, floored at one fp32 rounding (FP32_FLOOR, 2^-24; embeddings are exact in both). The
# bf16 error saturates in deep models (rel_l2 0.5 at the last layer of a 224M default-init
# checkpoint) while fp32's keeps growing, so a scaled bf16 envelope was too tight exactly where
# models get real (issue 26). Where from: FP32_FACTOR is measured by the census (tests/census):
# two independent fp32 computations of the same function (the port's TP partial sums, transformers'
# single rank) each err about as much against float64, so a healthy port sits near sqrt(2); the
# largest healthy ratio over the census is in docs/design.md (margin table); the smallest structural
# fault of tests/faults (the exact GELU) lands far above.
FP32_FACTOR = 8.0
FP32_FLOOR = 2.0 ** -24
# Host probabilities, both stages: the host transform judged as a function. The engine's served
# probabilities for the port's OWN raw logits against transformers' capped distribution of the same
# logits (harness.reference.run.transformers_capped: fp32, as transformers' Gemma-4 forward writes it),
# softmax taken in float64, every row. The same logits on both sides: no model noise enters, so a
# row's error is the fp32 softmax's own rounding. Per row, the largest relative error of a
# probability (over probabilities >= HOST_PROBABILITY_FLOOR: fp32 is normal there, and mass below
# it is the total variation's) within HOST_RELATIVE_TOLERANCE, and the total variation within
# HOST_TV_TOLERANCE. Where from: fp32 softmax of capped logits against its float64 value over
# vocabularies of 512 and 262144 (the 12B's), logits of scale 0.01 to 1000, bf16-valued or not
# (tests/unit/test_judge_numbers.py repeats the measurement): relative error up to
# 1.2e-5 and total variation up to 5.7e-6 at the 12B's vocabulary (the normalising sum's rounding
# over 262144 terms), 2.2e-6 and 1.2e-7 at 512. The tolerances sit 8x above: a wrong softcap, an
# uncapped softmax or a temperature of 0.999 moves relative errors to 1e-3 and more.
HOST_RELATIVE_TOLERANCE = 1e-4
HOST_TV_TOLERANCE = 5e-5
HOST_PROBABILITY_FLOOR = 1e-30
TOPK = 5

# fp32 stage: a token flip is a tie only when the reference's margin is within this fraction of the
# largest |logit| (fp32 rounding of the logits is ~1e-6 of it); anything wider is structural.
FP32_TIE_FRACTION = 1e-4


@dataclass(frozen=True)
class StageJudge:
    """How one stage judges: its points by `factor` x its envelope (bf16: the bf16 reference's
    error; fp32: the fp32 reference's error against float64), floored at `floor`, its token flips by
    the calibrated band (bf16: at least NEAR_TIE_ULPS ULPs) or by fp32 rounding (fp32). The host
    probabilities are judged as a function in both (compare_probabilities)."""

    name: str
    factor: float
    floor: float
    envelope_ties: bool  # bf16: ties within the calibrated band; fp32: within fp32 rounding only

    def tie_band(self, calibrated: float, ref_logits: torch.Tensor) -> float:
        if self.envelope_ties:
            return calibrated
        return FP32_TIE_FRACTION * float(ref_logits.abs().max())

    def describe(self) -> str:
        if self.envelope_ties:
            return "bf16 envelope"
        return (f"fp32 precision: error <= {self.factor:g}x the fp32 reference's own error against float64 at "
                "every point and position, tokens exact")


BF16 = StageJudge("bf16", ENVELOPE_FACTOR, ENVELOPE_FLOOR, True)
FP32 = StageJudge("fp32", FP32_FACTOR, FP32_FLOOR, False)
JUDGES = {"bf16": BF16, "fp32": FP32}


# ---- metrics -------------------------------------------------------------------------------------

def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().flatten(), ref.double().flatten()
    return float((x @ ref) / (x.norm() * ref.norm()).clamp_min(1e-30))


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max()) if x.numel() else 0.0


def per_position_rel_l2(x: torch.Tensor, ref: torch.Tensor, floor: float = ROW_NORM_FLOOR) -> torch.Tensor:
    """Relative L2 of each position (rows of [n, hidden]): one bad position is not averaged away.
    A row is measured against at least ROW_NORM_FLOOR x the point's median row norm: a gated
    point (the family's per-layer input, gate x input) has rows near zero whose own norm would turn
    bf16 rounding into a huge relative error; the residual streams' rows never come near it."""
    x, ref = x.double(), ref.double()
    norms = ref.norm(dim=-1)
    floor = floor * float(norms.median()) if norms.numel() else 0.0
    return (x - ref).norm(dim=-1) / norms.clamp_min(max(floor, 1e-30))


# ---- the point judge -----------------------------------------------------------------------------

def compare_point(name: str, device: torch.Tensor, ref: torch.Tensor, envelope: torch.Tensor,
                  judge: StageJudge = BF16, pooled: tuple[float, float] = (0.0, 0.0)) -> PointResult:
    """`device`, `ref` (fp32 reference) and `envelope` (the stage's envelope reference: bf16, or
    float64 in the fp32 stage) are [n, ...] at one point. The error is judged by the envelope's
    distance from `ref` (floored), whole tensor and worst position, each within the stage's factor.
    `pooled` (whole, worst position): floors from the same part at the other layers (pooled_floors)."""
    finite = bool(torch.isfinite(device).all())
    env = max(rel_l2(envelope, ref), judge.floor, pooled[0])
    err = rel_l2(device, ref) if finite else math.inf
    row_floor = 1.0 if name.rsplit(".", 1)[-1] in POOLED_PARTS else ROW_NORM_FLOOR
    dev_pos = per_position_rel_l2(device, ref, row_floor)
    env_pos_raw = per_position_rel_l2(envelope, ref, row_floor)
    env_pos = env_pos_raw.clamp_min(judge.floor)
    worst = int(dev_pos.argmax()) if finite else 0
    position_ratio = float(dev_pos.max() / max(float(env_pos.max()), pooled[1])) if finite else math.inf
    ratio = err / env
    result = PointResult(
        name=name, rel_l2=err, cosine=cosine(device, ref) if finite else float("nan"),
        max_abs=max_abs(device, ref) if finite else math.inf, envelope_rel_l2=env, ratio=ratio,
        position_ratio=position_ratio, worst_position=worst, finite=finite,
        passed=finite and ratio <= judge.factor and position_ratio <= judge.factor)
    result.position_r, result.lanes = position_r(dev_pos, env_pos_raw, judge.floor, pooled[0]), ref[:1].numel()
    return result


def pooled_floors(names: list[str], ref: dict, env: dict) -> tuple[float, float]:
    """The median over `names` (one part at every layer) of the envelope's whole-tensor and
    worst-position errors: the part's typical noise from many draws, not one."""
    if len(names) < POOLED_MIN_LAYERS:
        return 0.0, 0.0
    whole = torch.tensor([rel_l2(env[n], ref[n]) for n in names])
    worst = torch.tensor([float(per_position_rel_l2(env[n], ref[n], 1.0).max()) for n in names])
    return float(whole.median()), float(worst.median())


# ---- host probabilities ----------------------------------------------------------------------------

def compare_probabilities(name: str, dev_probs: torch.Tensor, expected_capped: torch.Tensor) -> ProbabilityResult:
    """dev_probs: the host's probabilities [n, vocab] for the port's own raw logits;
    expected_capped: transformers' capped logits of those same raw logits. Every row within fp32
    precision of softmax(expected_capped) (HOST_RELATIVE_TOLERANCE, HOST_TV_TOLERANCE); the ratio
    is the worst row's error over its tolerance (<= 1 passes). KL and top-k mass are reported."""
    if expected_capped.shape[0] == 0:
        return ProbabilityResult(name=name, rows=0, kl_mean=0.0, kl_max=0.0, topk_mass_error=0.0,
                                 relative_error_max=0.0, total_variation_max=0.0, ratio=0.0, worst_position=0,
                                 passed=True)
    p = torch.softmax(expected_capped.double(), -1)
    q = dev_probs.double()
    diff = (q - p).abs()
    judged = p >= HOST_PROBABILITY_FLOOR
    rel = torch.where(judged, diff / p.clamp_min(HOST_PROBABILITY_FLOOR), torch.zeros_like(p)).amax(-1)
    tv = 0.5 * diff.sum(-1)
    per_row = torch.maximum(rel / HOST_RELATIVE_TOLERANCE, tv / HOST_TV_TOLERANCE)
    finite = bool(torch.isfinite(q).all())
    ratio = float(per_row.max()) if finite and per_row.numel() else (0.0 if finite else math.inf)
    top = expected_capped.topk(min(TOPK, expected_capped.shape[-1]), -1).indices
    kl = (p * (p.clamp_min(1e-300).log() - q.clamp_min(1e-300).log())).sum(-1).clamp_min(0.0)
    mass = (q.gather(1, top).sum(-1) - p.gather(1, top).sum(-1)).abs()
    worst = int(per_row.nan_to_num(math.inf).argmax()) if per_row.numel() else 0
    return ProbabilityResult(name=name, rows=int(p.shape[0]), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                             topk_mass_error=float(mass.max()), relative_error_max=float(rel.max()),
                             total_variation_max=float(tv.max()), ratio=ratio, worst_position=worst,
                             passed=finite and ratio <= 1.0)
