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

# A point passes while its error is at most this multiple of the bf16 envelope. Where from: two
# bf16 computations that differ only in summation order (TP=2 partial sums reduced in fp32 vs one
# rank) carry rounding errors of the same size, so a healthy port sits near ratio 1 (measured on
# the tiny fixtures across seeds: at most ~1.6, tests/parity prints it); every fault in
# tests/faults lands at 10x or more. 4 leaves room for accumulation order without hiding a bug.
ENVELOPE_FACTOR = 4.0
# Envelope floor: bf16's unit roundoff 2^-9. A point whose bf16 envelope is smaller than one
# rounding (the embedding lookup, exact in both dtypes for some inputs) is judged against this.
ENVELOPE_FLOOR = 2.0 ** -9
# A token mismatch is a near-tie flip when the reference top-1/top-2 margin is within this many
# bf16 ULPs at the top-1 logit's magnitude ("a few ULPs", DESIGN §6; at 18 a bf16 ULP is 0.125) ...
NEAR_TIE_ULPS = 4
# ... or within this multiple of the largest logit error the bf16 reference itself shows at that
# position: two logits that each move by up to that much can swap across a margin of twice it.
# (The error on just the two competing logits is a single sample and underestimates it: a healthy
# bf16 port was measured flipping a 1.7 margin where those two logits' bf16 error was 0.4 and the
# position's largest was 1.5.)
NEAR_TIE_ENVELOPE = 2.0
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
        return "attention" if not self.points[0].passed else "mlp"

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
                        [compare_point(n, device[n], ref[n], envelope[n]) for n in layer_points(layer.index)])
            for layer in spec.layers]


# ---- tokens and logits ---------------------------------------------------------------------------

@dataclass
class TokenVerdict:
    """A position where the device's argmax differs from the reference's token."""

    position: int
    reference_token: int
    device_token: int
    margin: float  # reference top-1 minus top-2 (raw fp32 logits)
    threshold: float  # margins at or below this are near ties
    kind: str  # "near_tie" | "divergence"


def classify_mismatch(position: int, ref_row: torch.Tensor, dev_token: int,
                      env_row: torch.Tensor | None = None, ref_token: int | None = None) -> TokenVerdict:
    top1_val = float(ref_row.double().max())
    ref_token = int(ref_row.argmax()) if ref_token is None else ref_token
    # How much the reference prefers its token over the device's choice.
    margin = max(float(ref_row[ref_token].double() - ref_row[dev_token].double()), 0.0)
    threshold = NEAR_TIE_ULPS * bf16_ulp(top1_val)
    if env_row is not None:
        noise = float((env_row.double() - ref_row.double()).abs().max())
        threshold = max(threshold, NEAR_TIE_ENVELOPE * noise)
    return TokenVerdict(position, ref_token, int(dev_token), margin, threshold,
                        "near_tie" if margin <= threshold else "divergence")


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
                   cap: float | None, ref_tokens: list[int] | None = None, k: int = TOPK) -> LogitsResult:
    """device/ref/envelope: [n, vocab] raw logits. The device's choice is the argmax of its raw
    logits; the reference's is `ref_tokens` (its greedy choice) or its argmax. KL is taken between
    the capped distributions, KL(reference || device)."""
    n = ref.shape[0]
    if n == 0:
        return LogitsResult(0, 1.0, 1.0, 0.0, 0.0)
    dev_top1 = device.argmax(-1)
    ref_top1 = torch.tensor(ref_tokens) if ref_tokens is not None else softcap(ref, cap).argmax(-1)
    k = min(k, ref.shape[-1])
    dev_k, ref_k = device.topk(k, -1).indices, ref.topk(k, -1).indices
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(dev_k, ref_k)])
    log_p = torch.log_softmax(softcap(ref, cap).double(), -1)
    log_q = torch.log_softmax(softcap(device, cap).double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mismatches = [
        classify_mismatch(i, ref[i], int(dev_top1[i]), None if envelope is None else envelope[i],
                          int(ref_top1[i]))
        for i in range(n) if int(dev_top1[i]) != int(ref_top1[i])
        # the raw argmax may legitimately differ from the capped argmax only when the capped
        # maxima tie (softcap saturates); that is agreement, not a mismatch
        and float(softcap(ref[i:i + 1], cap)[0, dev_top1[i]]) != float(softcap(ref[i:i + 1], cap)[0].max())
    ]
    agree = 1.0 - len(mismatches) / n
    return LogitsResult(n, agree, float(overlap.mean()), float(kl.mean()), float(kl.max()), mismatches)
