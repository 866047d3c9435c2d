"""The judge: the one tolerance policy used by the suites, `check` and `bisect`.

Every calibration number lives here (docs/judging.md cites them). One settings object per stage
(`BF16`: the envelope stage, `FP32`: the structural stage), one point judge (`compare_point`), one
token-flip classifier (`classify_mismatch`) and one departure classifier (`classify_departure`):
every command judges what harness.observe observed with these, so the same observation gets the
same verdict wherever it is judged.

The port (bf16 on the device) is judged against the CPU fp32 reference by the error that the same
computation in bf16 on CPU already has at the same point: its noise envelope (docs/judging.md). A fixed
atol/rtol at bf16 either fails healthy ports or hides broken ones; a ratio to the envelope does
neither, and it carries over to checkpoints and configs the harness has never seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.numerics import bf16_ulp, softcap
from harness.points import layer_points
from harness.verdicts import (LayerResult, LogitsResult, NearTieCalibration, PointResult, ProbabilityResult,
                              TokenVerdict)

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
# A token mismatch is a near-tie flip when the reference prefers its token over the device's by
# no more than the noise of that margin. The noise is calibrated per check, from the data: over
# every position and prompt (prefill rows and decode steps), how far the bf16 reference's margin
# between the fp32 top-1 and each of its next NEAR_TIE_COMPETITORS moves against fp32. The band is
# NEAR_TIE_FACTOR x the NEAR_TIE_QUANTILE of those moves. Where from: on the tiny seeds 0 and 1 and
# on two transformers-default-init checkpoints (default prompts, 8 new tokens: 1660 margins each)
# the largest margin the healthy bf16 port flipped is 1.0x, 0.8x, 1.2x and 0.9x that quantile
# (3.39 vs 3.38, 1.38 vs 1.72, 0.22 vs 0.18, 0.15 vs 0.16): factor 2 keeps no false failure, and the
# band is one number per check, from the noise of the quantity that decides a flip (the margin),
# not the largest error anywhere in the vocabulary at each position. A flip the fp32 stage also
# shows is never a near tie.
NEAR_TIE_QUANTILE = 0.99
NEAR_TIE_FACTOR = 2.0
NEAR_TIE_COMPETITORS = 4
# The band never drops below this many bf16 ULPs at the top-1 logit's magnitude (a few ULPs: at
# 18 a bf16 ULP is 0.125): two logits one rounding apart can always swap.
NEAR_TIE_ULPS = 4
# MoE routing in the bf16 stage (harness/routing.py): a router choice off the fp32 top-k is a near
# tie within ROUTING_FACTOR x the ROUTING_QUANTILE of how far bf16 moves the top-k boundary margin
# (the same rule as tokens', on the k-th expert against the next), never below NEAR_TIE_ULPS ULPs.
ROUTING_QUANTILE = 0.99
ROUTING_FACTOR = 2.0
# PLE models (harness/forced_path.py force_references): a gated per-layer input row whose expected
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
# envelope is the bf16 envelope scaled by the ratio of the two unit roundoffs (fp32 2^-24 over bf16
# 2^-8): the same computation rounded 65536 times finer. Where from: on the tiny seeds 0 and 1 and
# two transformers-default-init checkpoints, the healthy fp32 port (TP=2 against transformers) sits
# at most at 2.4x that scaled envelope (whole tensor) and 3.3x (worst position) at every point
# (tests/parity prints it); a fixed
# tolerance does not carry over (default init's fp32 error is 6x the tiny builder's, a 48-layer model's
# more). FP32_FACTOR 16 leaves that headroom; the smallest structural fault of tests/faults (the
# exact GELU) lands at over 100x.
FP32_SCALE = 2.0 ** -16
FP32_FACTOR = 16.0
FP32_FLOOR = ENVELOPE_FLOOR * FP32_SCALE  # 2^-25: one fp32 rounding, for points exact in bf16 too
# fp32 stage, probabilities: the host softcap + softmax against transformers' capped distribution
# in fp32. KL from fp32 probabilities carries their rounding (~6e-8 relative each): measured up
# to 2.4e-7 on a healthy port, so 2e-6; a wrong formula is orders of magnitude above. The top-k mass
# error is held to FP32_MASS_TOLERANCE (measured up to 1.3e-6).
FP32_KL_TOLERANCE = 2e-6
FP32_MASS_TOLERANCE = 2e-5
# bf16 stage, probabilities: the host's per-row KL(reference || host) and top-k mass error are
# judged as a distribution against the bf16 reference's own per-row values, not row by row. At one
# row both are draws of a heavy-tailed quantity (a KL of a peaked distribution is ~ a chi-square
# of one or two degrees of freedom: two healthy bf16 runs differ 16x at single rows), so a row's
# ratio to the envelope's largest row false-alarms on healthy ports of other shapes. The host's
# transform (softcap, softmax) is the same at every row, so a wrong one moves the whole
# distribution: its mean and its PROBABILITY_QUANTILE move together. A point fault at one row is the
# logits point's to catch (judged per position). Where from: over healthy ports of eight shapes and
# seeds (tiny builder, transformers default init, 2 and 4 global KV heads, hidden 48 to 128) the
# judged ratio stays at or below 1.3 (docs/judging.md); every probability fault of
# tests/faults lands at 369x or more. The factor is ENVELOPE_FACTOR.
PROBABILITY_QUANTILE = 0.9
TOPK = 5

# fp32 stage: a token flip is a tie only when the reference's margin is within this fraction of the
# largest |logit| (fp32 rounding of the logits is ~1e-6 of it); anything wider is structural.
FP32_TIE_FRACTION = 1e-4


@dataclass(frozen=True)
class StageJudge:
    """How one stage judges: its points by `factor` x the bf16 envelope scaled by `scale` (floored
    at `floor`), its token flips by the calibrated band (bf16: at least NEAR_TIE_ULPS ULPs) or by
    fp32 rounding (fp32), its probabilities by the bf16 reference's (bf16) or by fp32 precision."""

    name: str
    factor: float
    scale: float
    floor: float
    envelope_ties: bool  # bf16: ties within the calibrated band; fp32: within fp32 rounding only

    def tie_band(self, calibrated: float, ref_logits: torch.Tensor) -> float:
        if self.envelope_ties:
            return calibrated
        return FP32_TIE_FRACTION * float(ref_logits.abs().max())

    def describe(self) -> str:
        if self.envelope_ties:
            return "bf16 envelope"
        return (f"fp32 precision: error <= {self.factor:g}x the bf16 envelope scaled to fp32 (x2^-16) at "
                "every point and position, tokens exact")


BF16 = StageJudge("bf16", ENVELOPE_FACTOR, 1.0, ENVELOPE_FLOOR, True)
FP32 = StageJudge("fp32", FP32_FACTOR, FP32_SCALE, FP32_FLOOR, False)
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


def per_position_rel_l2(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 of each position (rows of [n, hidden]): one bad position is not averaged away.
    A row is measured against at least ROW_NORM_FLOOR x the point's median row norm: a gated
    point (the family's per-layer input, gate x input) has rows near zero whose own norm would turn
    bf16 rounding into a huge relative error; the residual streams' rows never come near it."""
    x, ref = x.double(), ref.double()
    norms = ref.norm(dim=-1)
    floor = ROW_NORM_FLOOR * float(norms.median()) if norms.numel() else 0.0
    return (x - ref).norm(dim=-1) / norms.clamp_min(max(floor, 1e-30))


# ---- the point judge -----------------------------------------------------------------------------

def compare_point(name: str, device: torch.Tensor, ref: torch.Tensor, envelope: torch.Tensor,
                  judge: StageJudge = BF16) -> PointResult:
    """`device`, `ref` (fp32 reference) and `envelope` (bf16 reference) are [n, ...] at one point.
    The error is judged by the envelope scaled by the stage's scale, whole tensor and worst
    position, each within the stage's factor. The envelope fields hold the scaled envelope."""
    finite = bool(torch.isfinite(device).all())
    env = max(rel_l2(envelope, ref) * judge.scale, judge.floor)
    err = rel_l2(device, ref) if finite else math.inf
    dev_pos = per_position_rel_l2(device, ref)
    env_pos = (per_position_rel_l2(envelope, ref) * judge.scale).clamp_min(judge.floor)
    worst = int(dev_pos.argmax()) if finite else 0
    position_ratio = float(dev_pos.max() / env_pos.max()) if finite else math.inf
    ratio = err / env
    return PointResult(
        name=name, rel_l2=err, cosine=cosine(device, ref) if finite else float("nan"),
        max_abs=max_abs(device, ref) if finite else math.inf, envelope_rel_l2=env, ratio=ratio,
        position_ratio=position_ratio, worst_position=worst, finite=finite,
        passed=finite and ratio <= judge.factor and position_ratio <= judge.factor)


def stack_prompts(runs: list[dict], name: str) -> torch.Tensor:
    """One capture point of every prompt, stacked along the position rows."""
    return torch.cat([r[name] for r in runs], dim=0)


def compare_layers(spec, observed: tuple, judge: StageJudge = BF16, decode: bool = False) -> list[LayerResult]:
    """Every layer whose three points were observed: observed = (device, reference, envelope) dicts."""
    dev, ref, env = observed
    out = []
    for layer in spec.layers:
        names = layer_points(layer.index, decode, spec)
        if all(n in dev for n in names):
            out.append(LayerResult(layer.index, layer.type,
                                   [compare_point(n, dev[n], ref[n], env[n], judge) for n in names]))
    return out


# ---- tokens and logits ---------------------------------------------------------------------------

def margin_shifts(ref: torch.Tensor, env: torch.Tensor, competitors: int = NEAR_TIE_COMPETITORS) -> torch.Tensor:
    """|bf16 margin - fp32 margin| between each row's fp32 top-1 and its next `competitors`."""
    if ref.shape[0] == 0:
        return torch.empty(0, dtype=torch.double)
    top = ref.topk(min(competitors + 1, ref.shape[-1]), -1).indices
    first, rest = top[:, :1], top[:, 1:]
    m32 = ref.double().gather(1, first) - ref.double().gather(1, rest)
    m16 = env.double().gather(1, first) - env.double().gather(1, rest)
    return (m16 - m32).abs().flatten()


def calibrate_near_ties(pairs, quantile: float = NEAR_TIE_QUANTILE,
                        factor: float = NEAR_TIE_FACTOR) -> NearTieCalibration:
    """pairs: (fp32 reference logits, bf16 reference logits) [n, vocab] for every prompt's prefill
    rows and decode steps. The band is `factor` x the `quantile` of the margin shifts."""
    shifts = torch.cat([margin_shifts(r, e) for r, e in pairs] or [torch.empty(0, dtype=torch.double)])
    if shifts.numel() == 0:
        return NearTieCalibration(quantile=quantile, factor=factor, samples=0, shift_at_quantile=0.0,
                                  shift_max=0.0, band=0.0)
    at_q = float(torch.quantile(shifts, quantile))
    return NearTieCalibration(quantile=quantile, factor=factor, samples=int(shifts.numel()), shift_at_quantile=at_q,
                              shift_max=float(shifts.max()), band=factor * at_q)


def classify_mismatch(position: int, ref_row: torch.Tensor, dev_token: int, band: float = 0.0,
                      ref_token: int | None = None, structural: bool = False,
                      ulp_floor: bool = True) -> TokenVerdict:
    """A flip is a near tie when the reference's margin over the device's token is within `band`
    (the calibrated margin noise, at least NEAR_TIE_ULPS bf16 ULPs); a flip that the fp32 stage
    also shows (`structural`) is never a near tie."""
    top1_val = float(ref_row.double().max())
    ref_token = int(ref_row.argmax()) if ref_token is None else ref_token
    margin = max(float(ref_row[ref_token].double() - ref_row[dev_token].double()), 0.0)
    threshold = max(band, NEAR_TIE_ULPS * bf16_ulp(top1_val)) if ulp_floor else band
    if structural:
        kind, evidence = "divergence", "the fp32 port flips here too: structural, not rounding"
    elif margin <= threshold:
        kind, evidence = "near_tie", f"margin {margin:.4f} within the near-tie band {threshold:.4f}"
    else:
        kind, evidence = "divergence", f"margin {margin:.4f} above the near-tie band {threshold:.4f}"
    return TokenVerdict(position=position, reference_token=ref_token, device_token=int(dev_token), margin=margin,
                        threshold=threshold, kind=kind, evidence=evidence)


def saturation_tie(ref_capped_row: torch.Tensor, dev_token: int) -> bool:
    """The raw argmax may legitimately differ from the capped argmax only when the capped maxima
    tie (softcap saturates): the device's token is then among the reference's capped maxima."""
    return float(ref_capped_row[dev_token]) == float(ref_capped_row.max())


def classify_departure(reference, run, band: float, structural: set, judge: StageJudge = BF16):
    """Where the free-running sequence first departs from the reference, classified, or None.
    reference: .generated, .step_logits, .captures; run: .free and .forced (.tokens, .step_logits).
    unexplained: the free run's token is not what its own logits, or the same prefix
    teacher-forced, choose; saturation_tie: among the reference's capped maxima; else the flip's
    class (a flip the fp32 stage also shows, `structural`, is never a near tie)."""
    tokens, ref = run.free.tokens, reference.generated
    if tokens == ref:
        return None
    s = next(i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b)
    dev, own, forced_choice = tokens[s], int(run.free.step_logits[s].argmax()), int(run.forced.step_logits[s].argmax())
    if dev != own or dev != forced_choice:
        return TokenVerdict(position=s, reference_token=ref[s], device_token=dev, margin=math.nan,
                            threshold=math.nan, kind="unexplained",
                            evidence=f"the free run chose {dev} at step {s}, but the argmax of its logits is {own} "
                                     f"and the same prefix teacher-forced gives {forced_choice}")
    capped = reference.captures.get("step_capped_logits")
    if capped is not None and saturation_tie(capped[s], dev):
        return TokenVerdict(position=s, reference_token=ref[s], device_token=dev, margin=0.0, threshold=0.0,
                            kind="saturation_tie", evidence="the device's raw argmax is among the reference's "
                                                            "capped maxima (softcap saturates)")
    return classify_mismatch(s, reference.step_logits[s], dev, band, ref_token=ref[s], structural=s in structural,
                             ulp_floor=judge.envelope_ties)


def compare_logits(device: torch.Tensor, ref: torch.Tensor, envelope: torch.Tensor | None,
                   cap: float | None, ref_tokens: list[int] | None = None, k: int = TOPK,
                   band: float | None = None, structural=frozenset(), ref_capped: torch.Tensor | None = None,
                   dev_probs: torch.Tensor | None = None, ulp_floor: bool = True) -> LogitsResult:
    """device/ref/envelope: [n, vocab] raw logits. The device's choice is the argmax of its raw
    logits; the reference's is `ref_tokens` (its greedy choice) or its capped argmax. Mismatches
    are classified by `band` (calibrated from `envelope` when not given); rows in `structural` are
    flips the fp32 stage shows too. KL(reference || device) is taken between the reference's own
    capped distribution (`ref_capped`, transformers') and the host's (`dev_probs`), each falling
    back to the softcap of the raw logits."""
    n = ref.shape[0]
    if n == 0:
        return LogitsResult(positions=0, top1_agreement=1.0, topk_overlap=1.0, kl_mean=0.0, kl_max=0.0)
    if band is None:
        band = calibrate_near_ties([(ref, envelope)]).band if envelope is not None else 0.0
    ref_capped = softcap(ref, cap) if ref_capped is None else ref_capped.float()
    dev_top1 = device.argmax(-1)
    ref_top1 = torch.tensor(ref_tokens) if ref_tokens is not None else ref_capped.argmax(-1)
    k = min(k, ref.shape[-1])
    dev_k, ref_k = device.topk(k, -1).indices, ref.topk(k, -1).indices
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(dev_k, ref_k)])
    log_p = torch.log_softmax(ref_capped.double(), -1)
    log_q = (torch.log_softmax(softcap(device, cap).double(), -1) if dev_probs is None
             else dev_probs.double().clamp_min(1e-300).log())
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mismatches = [classify_mismatch(i, ref[i], int(dev_top1[i]), band, ref_token=int(ref_top1[i]),
                                    structural=i in structural, ulp_floor=ulp_floor)
                  for i in range(n) if int(dev_top1[i]) != int(ref_top1[i])
                  and not saturation_tie(ref_capped[i], int(dev_top1[i]))]
    agree = 1.0 - len(mismatches) / n
    return LogitsResult(positions=n, top1_agreement=agree, topk_overlap=float(overlap.mean()),
                        kl_mean=float(kl.mean()), kl_max=float(kl.max()), mismatches=mismatches)


# ---- host probabilities ----------------------------------------------------------------------------

def _kl_and_mass(probs: torch.Tensor, ref_p: torch.Tensor, top: torch.Tensor):
    log_p = ref_p.clamp_min(1e-300).log()
    kl = (ref_p * (log_p - probs.double().clamp_min(1e-300).log())).sum(-1)
    mass = (probs.double().gather(1, top).sum(-1) - ref_p.gather(1, top).sum(-1)).abs()
    return kl, mass


def distribution_ratio(device: torch.Tensor, envelope: torch.Tensor, floor: float) -> float:
    """How far per-row device values sit above the envelope's, as distributions: the larger of the
    ratios of their means and of their PROBABILITY_QUANTILEs (each envelope statistic floored)."""
    if device.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(device).all()):
        return math.inf
    ratios = [float(device.mean()) / max(float(envelope.mean()), floor)]
    at_q = float(torch.quantile(device, PROBABILITY_QUANTILE))
    ratios.append(at_q / max(float(torch.quantile(envelope, PROBABILITY_QUANTILE)), floor))
    return max(ratios)


def compare_probabilities(name: str, dev_probs: torch.Tensor, ref_capped: torch.Tensor,
                          env_capped: torch.Tensor | None, factor: float = ENVELOPE_FACTOR) -> ProbabilityResult:
    """dev_probs: the host's probabilities [n, vocab]; ref_capped/env_capped: the fp32/bf16
    references' capped logits. bf16 stage: the distribution of per-row KL and top-k mass error
    against the bf16 reference's (distribution_ratio) within `factor`. Without an envelope (fp32
    stage) every row within fp32 precision (FP32_KL_TOLERANCE, FP32_MASS_TOLERANCE)."""
    ref_p = torch.softmax(ref_capped.double(), -1)
    top = ref_capped.topk(min(TOPK, ref_capped.shape[-1]), -1).indices
    kl, mass = _kl_and_mass(dev_probs, ref_p, top)
    if env_capped is None:
        env_kl, env_mass = torch.zeros_like(kl), torch.zeros_like(mass)
        per_row = torch.maximum(kl / FP32_KL_TOLERANCE, mass / FP32_MASS_TOLERANCE)
        ratio = float(per_row.max()) if bool(torch.isfinite(per_row).all()) else math.inf
        factor = 1.0
    else:
        env_kl, env_mass = _kl_and_mass(torch.softmax(env_capped.double(), -1), ref_p, top)
        ratio = max(distribution_ratio(kl, env_kl, FP32_KL_TOLERANCE),
                    distribution_ratio(mass, env_mass, FP32_MASS_TOLERANCE))
    worst = int(kl.nan_to_num(math.inf).argmax()) if kl.numel() else 0
    return ProbabilityResult(name=name, kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                             topk_mass_error=float(mass.max()), envelope_kl_max=float(env_kl.max()),
                             envelope_topk_mass_error=float(env_mass.max()), ratio=ratio, worst_position=worst,
                             passed=math.isfinite(ratio) and ratio <= factor)
