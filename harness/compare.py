"""Metrics and the one tolerance policy used by the suites, `check` and `bisect`.

The port (bf16 on the device) is judged against the CPU fp32 reference by the error that the same
computation in bf16 on CPU already has at the same point: its noise envelope (DESIGN §6). A fixed
atol/rtol at bf16 either fails healthy ports or hides broken ones; a ratio to the envelope does
neither, and it carries over to checkpoints and configs the harness has never seen.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from harness.numerics import bf16_ulp, softcap
from harness.spec_family import layer_points_for, part_of_point

# A point passes while its error is at most this multiple of the bf16 envelope. Where from: two
# bf16 computations that differ only in summation order (TP=2 partial sums reduced in fp32 vs one
# rank) carry rounding errors of the same size, so a healthy port sits near ratio 1 (measured on
# the tiny fixtures across seeds: at most ~1.6, tests/parity prints it); every fault in
# tests/faults lands at 10x or more. 4 leaves room for accumulation order without hiding a bug.
ENVELOPE_FACTOR = 4.0
# Envelope floor: bf16's unit roundoff 2^-9. A point whose bf16 envelope is smaller than one
# rounding (the embedding lookup, exact in both dtypes for some inputs) is judged against this.
ENVELOPE_FLOOR = 2.0 ** -9
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
# The band never drops below this many bf16 ULPs at the top-1 logit's magnitude (DESIGN §6: "a
# few ULPs"; at 18 a bf16 ULP is 0.125): two logits one rounding apart can always swap.
NEAR_TIE_ULPS = 4
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
TOPK = 5


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().flatten(), ref.double().flatten()
    return float((x @ ref) / (x.norm() * ref.norm()).clamp_min(1e-30))


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max()) if x.numel() else 0.0


def per_position_rel_l2(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 of each position (rows of [n, hidden]): one bad position is not averaged away."""
    x, ref = x.double(), ref.double()
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


@dataclass
class PointResult:
    """One capture point: the device against fp32, judged by the bf16 envelope."""

    name: str
    rel_l2: float
    cosine: float
    max_abs: float
    envelope_rel_l2: float
    ratio: float  # whole-tensor error / envelope
    position_ratio: float  # worst position's error / worst position's envelope
    worst_position: int  # row of the prompts stacked in order (bisect maps it to prompt, position)
    finite: bool
    passed: bool

    @property
    def required_factor(self) -> float:
        """The ENVELOPE_FACTOR that would have let this point pass."""
        return max(self.ratio, self.position_ratio)

    def explain(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if not self.finite:
            return f"{self.name}: FAIL, device output has NaN or Inf"
        return (f"{self.name}: {verdict} rel_l2={self.rel_l2:.3e} (bf16 envelope "
                f"{self.envelope_rel_l2:.3e}, ratio {self.ratio:.2f}; worst row "
                f"{self.worst_position} ratio {self.position_ratio:.2f}), cosine={self.cosine:.6f}, "
                f"max_abs={self.max_abs:.3e}; tolerance {ENVELOPE_FACTOR}x envelope, would pass at "
                f"{self.required_factor:.2f}x")


def compare_point(name: str, device: torch.Tensor, ref: torch.Tensor, envelope: torch.Tensor,
                  factor: float = ENVELOPE_FACTOR) -> PointResult:
    """`device`, `ref` (fp32 reference) and `envelope` (bf16 reference) are [n, ...] at one point."""
    finite = bool(torch.isfinite(device).all())
    env = max(rel_l2(envelope, ref), ENVELOPE_FLOOR)
    err = rel_l2(device, ref) if finite else math.inf
    dev_pos = per_position_rel_l2(device, ref)
    env_pos = per_position_rel_l2(envelope, ref).clamp_min(ENVELOPE_FLOOR)
    worst = int(dev_pos.argmax()) if finite else 0
    position_ratio = float(dev_pos.max() / env_pos.max()) if finite else math.inf
    ratio = err / env
    return PointResult(
        name=name, rel_l2=err, cosine=cosine(device, ref) if finite else float("nan"),
        max_abs=max_abs(device, ref) if finite else math.inf, envelope_rel_l2=env, ratio=ratio,
        position_ratio=position_ratio, worst_position=worst, finite=finite,
        passed=finite and ratio <= factor and position_ratio <= factor,
    )


def compare_point_fp32(name: str, device: torch.Tensor, ref: torch.Tensor, envelope: torch.Tensor,
                       factor: float = FP32_FACTOR) -> PointResult:
    """The fp32 stage's judge: the port in fp32 against the fp32 reference, by the bf16 envelope
    (`envelope` is the bf16 reference) scaled to fp32 (FP32_SCALE), whole tensor and worst position,
    each within `factor`. The envelope fields hold the scaled envelope."""
    finite = bool(torch.isfinite(device).all())
    env = max(rel_l2(envelope, ref) * FP32_SCALE, FP32_FLOOR)
    err = rel_l2(device, ref) if finite else math.inf
    dev_pos = per_position_rel_l2(device, ref)
    env_pos = (per_position_rel_l2(envelope, ref) * FP32_SCALE).clamp_min(FP32_FLOOR)
    worst = int(dev_pos.argmax()) if finite else 0
    position_ratio = float(dev_pos.max() / env_pos.max()) if finite else math.inf
    ratio = err / env
    return PointResult(
        name=name, rel_l2=err, cosine=cosine(device, ref) if finite else float("nan"),
        max_abs=max_abs(device, ref) if finite else math.inf, envelope_rel_l2=env, ratio=ratio,
        position_ratio=position_ratio, worst_position=worst, finite=finite,
        passed=finite and ratio <= factor and position_ratio <= factor)


def layer_points(index: int) -> list[str]:
    return [f"layers.{index}.attn_residual", f"layers.{index}.mlp_residual", f"layers.{index}.output"]


@dataclass
class LayerResult:
    index: int
    type: str
    points: list[PointResult]

    @property
    def output(self) -> PointResult:
        return self.points[-1]

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.points)

    @property
    def component(self) -> str | None:
        """Which part of the layer first breaks the policy: attention (the attention residual
        point) or mlp (only the MLP residual or the scaled output)."""
        if self.passed:
            return None
        return part_of_point(next(p.name for p in self.points if not p.passed))

    def to_json(self) -> dict:
        out = self.output
        return {"index": self.index, "type": self.type, "rel_l2": out.rel_l2, "cosine": out.cosine,
                "max_abs": out.max_abs, "envelope_rel_l2": out.envelope_rel_l2, "ratio": out.ratio,
                "position_ratio": out.position_ratio, "pass": self.passed, "component": self.component,
                "points": [asdict(p) for p in self.points]}


def stack_prompts(runs: list[dict], name: str) -> torch.Tensor:
    """One capture point of every prompt, stacked along the position rows."""
    return torch.cat([r[name] for r in runs], dim=0)


def compare_layers(spec, device: dict, ref: dict, envelope: dict) -> list[LayerResult]:
    return [LayerResult(layer.index, layer.type,
                        [compare_point(n, device[n], ref[n], envelope[n]) for n in layer_points_for(spec, layer.index)])
            for layer in spec.layers]


# ---- tokens and logits ---------------------------------------------------------------------------

@dataclass
class NearTieCalibration:
    """The near-tie band of one check: NEAR_TIE_FACTOR x the NEAR_TIE_QUANTILE of how far bf16
    moves the reference's top-1 margins against fp32, over every position and prompt."""

    quantile: float
    factor: float
    samples: int
    shift_at_quantile: float
    shift_max: float
    band: float

    def describe(self) -> str:
        return (f"near-tie band {self.band:.3f} logits = {self.factor:g} x the {self.quantile:g} quantile "
                f"({self.shift_at_quantile:.3f}) of how far bf16 moves the reference's top-1 margins "
                f"against fp32 ({self.samples} margins over every position and prompt; largest "
                f"{self.shift_max:.3f})")


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
        return NearTieCalibration(quantile, factor, 0, 0.0, 0.0, 0.0)
    at_q = float(torch.quantile(shifts, quantile))
    return NearTieCalibration(quantile, factor, int(shifts.numel()), at_q, float(shifts.max()), factor * at_q)


@dataclass
class TokenVerdict:
    """A position where the device's choice differs from the reference's token, its class and the
    evidence for it."""

    position: int
    reference_token: int
    device_token: int
    margin: float  # how much the reference prefers its token over the device's (raw fp32 logits)
    threshold: float  # margins at or below this are near ties
    kind: str  # "near_tie" | "divergence"
    evidence: str = ""


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
    return TokenVerdict(position, ref_token, int(dev_token), margin, threshold, kind, evidence)


def saturation_tie(ref_capped_row: torch.Tensor, dev_token: int) -> bool:
    """The raw argmax may legitimately differ from the capped argmax only when the capped maxima
    tie (softcap saturates): the device's token is then among the reference's capped maxima."""
    return float(ref_capped_row[dev_token]) == float(ref_capped_row.max())


@dataclass
class LogitsResult:
    """Per-position agreement between device and reference logits (rows are positions)."""

    positions: int
    top1_agreement: float
    topk_overlap: float
    kl_mean: float
    kl_max: float
    mismatches: list[TokenVerdict] = field(default_factory=list)

    @property
    def near_ties(self) -> int:
        return sum(v.kind == "near_tie" for v in self.mismatches)

    @property
    def divergences(self) -> int:
        return sum(v.kind == "divergence" for v in self.mismatches)

    def to_json(self) -> dict:
        d = asdict(self)
        d["near_ties"], d["divergences"] = self.near_ties, self.divergences
        return d


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
        return LogitsResult(0, 1.0, 1.0, 0.0, 0.0)
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
    mismatches = [classify_mismatch(i, ref[i], int(dev_top1[i]), band, int(ref_top1[i]), i in structural, ulp_floor)
                  for i in range(n) if int(dev_top1[i]) != int(ref_top1[i])
                  and not saturation_tie(ref_capped[i], int(dev_top1[i]))]
    agree = 1.0 - len(mismatches) / n
    return LogitsResult(n, agree, float(overlap.mean()), float(kl.mean()), float(kl.max()), mismatches)


@dataclass
class ProbabilityResult:
    """The host's served distribution (softcap + softmax) against the reference's own capped one:
    KL(reference || host) and the mass the host puts on the reference's top-k, judged by the bf16
    reference's own values (bf16 stage) or fp32 precision (fp32 stage)."""

    name: str
    kl_mean: float
    kl_max: float
    topk_mass_error: float  # largest |host mass - reference mass| on the reference's top-k
    envelope_kl_max: float
    envelope_topk_mass_error: float
    ratio: float
    worst_position: int
    passed: bool

    def explain(self) -> str:
        return (f"{self.name}: {'PASS' if self.passed else 'FAIL'} KL max {self.kl_max:.3e} (envelope "
                f"{self.envelope_kl_max:.3e}), top-{TOPK} mass error {self.topk_mass_error:.3e} (envelope "
                f"{self.envelope_topk_mass_error:.3e}), ratio {self.ratio:.2f} at row {self.worst_position}")


def _kl_and_mass(probs: torch.Tensor, ref_p: torch.Tensor, top: torch.Tensor):
    log_p = ref_p.clamp_min(1e-300).log()
    kl = (ref_p * (log_p - probs.double().clamp_min(1e-300).log())).sum(-1)
    mass = (probs.double().gather(1, top).sum(-1) - ref_p.gather(1, top).sum(-1)).abs()
    return kl, mass


def compare_probabilities(name: str, dev_probs: torch.Tensor, ref_capped: torch.Tensor,
                          env_capped: torch.Tensor | None, factor: float = ENVELOPE_FACTOR) -> ProbabilityResult:
    """dev_probs: the host's probabilities [n, vocab]; ref_capped/env_capped: the fp32/bf16
    references' capped logits. Without an envelope (fp32 stage) the floors are fp32 precision."""
    ref_p = torch.softmax(ref_capped.double(), -1)
    top = ref_capped.topk(min(TOPK, ref_capped.shape[-1]), -1).indices
    kl, mass = _kl_and_mass(dev_probs, ref_p, top)
    if env_capped is None:
        env_kl, env_mass, factor = torch.zeros_like(kl), torch.zeros_like(mass), 1.0
        kl_floor, mass_floor = FP32_KL_TOLERANCE, FP32_MASS_TOLERANCE
    else:
        env_kl, env_mass = _kl_and_mass(torch.softmax(env_capped.double(), -1), ref_p, top)
        kl_floor = max(float(env_kl.max()), FP32_KL_TOLERANCE)
        mass_floor = max(float(env_mass.max()), ENVELOPE_FLOOR)
    per_row = torch.maximum(kl / kl_floor, mass / mass_floor)
    finite = bool(torch.isfinite(per_row).all())
    ratio = float(per_row.max()) if finite else math.inf
    return ProbabilityResult(name, float(kl.mean()), float(kl.max()), float(mass.max()), float(env_kl.max()),
                             float(env_mass.max()), ratio, int(per_row.nan_to_num(math.inf).argmax()),
                             finite and ratio <= factor)
