"""The judge of tokens: the one rule for a choice decided on the port's own path (`own_path_choice`:
tokens and routers), the tail band calibrated from the references' margins where no own path is
at hand (`calibrate_band`, tokens via `calibrate_near_ties`), the one tie helper (`tie_threshold`:
tokens, routers and the served build), the one flip classifier (`classify_mismatch`), the one
departure classifier (`classify_departure`) and the logits' verdict (`compare_logits`). The numbers
they use are the tolerance policy's (harness/judge/compare.py)."""

from __future__ import annotations

import math

import torch

from harness.base.numerics import bf16_ulp, softcap
from harness.judge.compare import (BF16, DECISION_HEADROOM, NEAR_TIE_COMPETITORS, NEAR_TIE_FACTOR, NEAR_TIE_QUANTILE,
                                   NEAR_TIE_ULPS, TOPK, StageJudge)
from harness.judge.verdicts import LogitsResult, NearTieCalibration, TokenVerdict

def margin_shifts(ref: torch.Tensor, env: torch.Tensor, competitors: int = NEAR_TIE_COMPETITORS,
                  rank: int = 1) -> torch.Tensor:
    """|bf16 margin - fp32 margin| between each row's fp32 `rank`-th value and its next
    `competitors` (tokens: the top-1 and the next NEAR_TIE_COMPETITORS; a router: the k-th expert
    and the best left out); empty where a row has no competitor."""
    if ref.shape[0] == 0 or rank >= ref.shape[-1]:
        return torch.empty(0, dtype=torch.double)
    top = ref.double().topk(min(rank + competitors, ref.shape[-1]), -1).indices
    inside, rest = top[:, rank - 1:rank], top[:, rank:]
    m32 = ref.double().gather(1, inside) - ref.double().gather(1, rest)
    m16 = env.double().gather(1, inside) - env.double().gather(1, rest)
    return (m16 - m32).abs().flatten()


def calibrate_band(shifts: list[torch.Tensor], quantile: float = NEAR_TIE_QUANTILE,
                   factor: float = NEAR_TIE_FACTOR) -> NearTieCalibration:
    """The one band calibration: `factor` x the `quantile` of the margin shifts (margin_shifts) of
    every decision, from the references alone (0 without any). The policy's quantile is 1, the
    largest shift: the band sits on the tail, which a quantile misses where attention is sharp."""
    shifts = torch.cat(list(shifts) or [torch.empty(0, dtype=torch.double)]).double()
    if shifts.numel() == 0:
        return NearTieCalibration(quantile=quantile, factor=factor, samples=0, shift_at_quantile=0.0,
                                  shift_max=0.0, band=0.0)
    at_q = float(torch.quantile(shifts, quantile))
    return NearTieCalibration(quantile=quantile, factor=factor, samples=int(shifts.numel()), shift_at_quantile=at_q,
                              shift_max=float(shifts.max()), band=factor * at_q)


def calibrate_near_ties(pairs, quantile: float = NEAR_TIE_QUANTILE,
                        factor: float = NEAR_TIE_FACTOR) -> NearTieCalibration:
    """pairs: (fp32 reference logits, bf16 reference logits) [n, vocab] for every prompt's prefill
    rows and decode steps. The band is `factor` x the `quantile` of the margin shifts."""
    return calibrate_band([margin_shifts(r, e) for r, e in pairs], quantile, factor)


def tie_threshold(band: float, row: torch.Tensor, ulp_floor: bool = True) -> float:
    """The one tie helper: how far apart two values of `row` may be and still swap legitimately:
    the calibrated `band`, at least NEAR_TIE_ULPS bf16 ULPs of the row's largest magnitude (the
    one ULP basis; see NEAR_TIE_ULPS) unless `ulp_floor` is off (the fp32 stage)."""
    if not ulp_floor or row.numel() == 0:
        return band
    return max(band, NEAR_TIE_ULPS * bf16_ulp(float(row.double().abs().max())))


def own_path_choice(chosen: set, alone32: torch.Tensor, alone16: torch.Tensor, k: int = 1) -> tuple:
    """The one rule for a choice decided on the port's own path: `alone32`/`alone16` are
    transformers' fp32 and bf16 computation of that one decision (the head, a router) fed the very
    input the port had; `chosen` the port's choice (a token, or k experts). The same choice as
    transformers' bf16 (or fp32) there passes; otherwise the fp32 margin of the swap (the best it
    left out minus the worst it took) must be inside DECISION_HEADROOM x what bf16 moved that very
    margin on that input (at least NEAR_TIE_ULPS bf16 ULPs). A port that computes something else
    differs from transformers on the same input, by more than rounding: it fails.
    Returns (accounted, margin, threshold, evidence)."""
    top32 = set(alone32.topk(k).indices.tolist())
    top16 = set(alone16.topk(k).indices.tolist())
    if chosen in (top16, top32):
        which = "bf16" if chosen == top16 else "fp32"
        return True, 0.0, 0.0, f"transformers' {which} computation on the port's own input makes the same choice"
    best = max(top32 - chosen, key=lambda i: float(alone32[i]))
    worst = min(chosen - top32, key=lambda i: float(alone32[i]))
    margin = float(alone32[best].double() - alone32[worst].double())
    moved = abs(float(alone16[best].double() - alone16[worst].double()) - margin)
    threshold = tie_threshold(DECISION_HEADROOM * moved, alone32)
    inside = margin <= threshold
    return inside, margin, threshold, (
        f"on the port's own input transformers chooses {sorted(top32)}: margin {margin:.4f} "
        f"{'within' if inside else 'above'} {DECISION_HEADROOM:g} x what bf16 moves it ({moved:.4f}; "
        f"threshold {threshold:.4f})")


def classify_mismatch(position: int, ref_row: torch.Tensor, dev_token: int, band: float = 0.0,
                      ref_token: int | None = None, structural: bool = False,
                      ulp_floor: bool = True, alone: tuple | None = None) -> TokenVerdict:
    """A flip that the fp32 stage also shows (`structural`) is never a near tie. Else, with `alone`
    (transformers' fp32 and bf16 head on the port's own input to it, the bf16 stage): decided by
    own_path_choice. Without it: a near tie when the reference's margin over the device's token is
    within `band` (the tail band, at least NEAR_TIE_ULPS bf16 ULPs: tie_threshold)."""
    ref_token = int(ref_row.argmax()) if ref_token is None else ref_token
    margin = max(float(ref_row[ref_token].double() - ref_row[dev_token].double()), 0.0)
    threshold = tie_threshold(band, ref_row, ulp_floor)
    if structural:
        kind, evidence = "divergence", "the fp32 port flips here too: structural, not rounding"
    elif alone is not None:
        inside, margin, threshold, evidence = own_path_choice({int(dev_token)}, *alone)
        kind = "near_tie" if inside else "divergence"
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


def _tie_evidence(ref_raw_row: torch.Tensor, dev_token: int) -> str:
    """Why a tie among the reference's capped maxima is one: raw logits that tie exactly (always so
    on a model without a softcap, whose capped logits are the raw ones), or distinct raw logits the
    softcap rounds to one value."""
    if float(ref_raw_row[dev_token]) == float(ref_raw_row.max()):
        return "the device's token ties the reference's largest raw logit exactly"
    return "the device's raw argmax is among the reference's capped maxima (softcap saturates)"


def classify_departure(reference, free, band: float, forced=None, structural=frozenset(),
                       judge: StageJudge = BF16, alone=None) -> TokenVerdict | None:
    """Where a free-running sequence first departs from the reference, classified, or None: the
    one departure classifier (the check's free run, harness/judge/stage.py; the served build's,
    harness/parity/served.py). reference: .generated, .step_logits, .captures; free: .tokens and
    .step_logits of the free run; forced: .step_logits of the same prompt teacher-forced (None: not
    run). unexplained: a run of another length, or a token that is not what the run's own logits
    (or the same prefix teacher-forced) choose; saturation_tie: among the reference's capped maxima;
    else the flip's class (a flip the fp32 stage also shows, `structural`, is never a near tie;
    alone(step): transformers' head on the port's input at that step, as classify_mismatch takes it)."""
    tokens, ref = list(free.tokens), list(reference.generated)
    if tokens == ref:
        return None
    s = next((i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), min(len(ref), len(tokens)))
    if s == min(len(ref), len(tokens)):  # one run is a prefix of the other
        return TokenVerdict(position=s, reference_token=ref[s] if s < len(ref) else -1,
                            device_token=tokens[s] if s < len(tokens) else -1, margin=math.nan, threshold=math.nan,
                            kind="unexplained", evidence=f"the free run produced {len(tokens)} tokens where the "
                                                         f"reference has {len(ref)}")
    dev, own = tokens[s], int(free.step_logits[s].argmax())
    forced_choice = own if forced is None else int(forced.step_logits[s].argmax())
    if dev != own or dev != forced_choice:
        also = "" if forced is None else f" and the same prefix teacher-forced gives {forced_choice}"
        return TokenVerdict(position=s, reference_token=ref[s], device_token=dev, margin=math.nan,
                            threshold=math.nan, kind="unexplained",
                            evidence=f"the free run chose {dev} at step {s}, but the argmax of its logits is {own}{also}")
    capped = reference.captures.get("step_capped_logits")
    if capped is not None and saturation_tie(capped[s], dev):
        return TokenVerdict(position=s, reference_token=ref[s], device_token=dev, margin=0.0, threshold=0.0,
                            kind="saturation_tie", evidence=_tie_evidence(reference.step_logits[s], dev))
    return classify_mismatch(s, reference.step_logits[s], dev, band, ref_token=ref[s], structural=s in structural,
                             ulp_floor=judge.envelope_ties, alone=alone(s) if alone and judge.envelope_ties else None)


def compare_logits(device: torch.Tensor, ref: torch.Tensor, envelope: torch.Tensor | None,
                   cap: float | None, ref_tokens: list[int] | None = None, k: int = TOPK,
                   band: float | None = None, structural=frozenset(), ref_capped: torch.Tensor | None = None,
                   dev_probs: torch.Tensor | None = None, ulp_floor: bool = True, alone=None) -> LogitsResult:
    """device/ref/envelope: [n, vocab] raw logits. The device's choice is the argmax of its raw
    logits; the reference's is `ref_tokens` (its greedy choice) or its capped argmax. Mismatches
    are classified by `band` (calibrated from `envelope` when not given); rows in `structural` are
    flips the fp32 stage shows too. KL(reference || device) is taken between the reference's own
    capped distribution (`ref_capped`, transformers') and the host's (`dev_probs`), each falling
    back to the softcap of the raw logits. alone(row): transformers' head on the port's own input
    at that row (classify_mismatch), or None."""
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
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)  # >= 0: a negative row is rounding
    mismatches = [classify_mismatch(i, ref[i], int(dev_top1[i]), band, ref_token=int(ref_top1[i]),
                                    structural=i in structural, ulp_floor=ulp_floor,
                                    alone=alone(i) if alone and ulp_floor else None)
                  for i in range(n) if int(dev_top1[i]) != int(ref_top1[i])
                  and not saturation_tie(ref_capped[i], int(dev_top1[i]))]
    agree = 1.0 - len(mismatches) / n
    return LogitsResult(positions=n, top1_agreement=agree, topk_overlap=float(overlap.mean()),
                        kl_mean=float(kl.mean()), kl_max=float(kl.max()), mismatches=mismatches)
