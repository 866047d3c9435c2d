"""Precision-ordering faults (issue 38): a rounding to bf16 earlier than the reference does it (the
port less precise: R's median rises above 1 at every position, the distributional gate of
harness/judge/distribution.py fails it) or later (an extra fp32 stretch: R's median drops below 1,
over-precision, harness/judge/precision.py flags it). Each is the kind of bug AWS's equivalence
table names ("precision ordering or missing multiplier", "over-precision"), in norms, attention,
the MLP, the residual and layer scalar, rope and the scales, each injected into the port only.
`python -m tests.faults.precision` prints what caught each (the table in docs/faults.md)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from harness.backends import cpu as port_cpu
from harness.base.points import Point
from harness.port import blocks as port_blocks
from harness.port import engine as port_engine
from harness.port import model as port_model
from tests.faults.catalog import (TINY, TINY_INEXACT_SCALE, embed_scale_not_cast, rms_norm_without_fp32,
                                  run_faulty_check)


@dataclass(frozen=True)
class PrecisionFault:
    name: str
    where: str  # norms | attention | mlp | residual | rope | scales | collectives
    description: str
    inject: Callable
    flag: str  # "gate": the distributional gate fails check; "over": over-precision is flagged
    point: str  # where the verdict must say it starts (a capture point; its layer and part)
    checkpoint: str = TINY
    twin: str | None = None  # the fault rounding the other way at the same place


# ---- rounding earlier than the reference (under-precision) ----------------------------------------

def rms_norm_weight_after_cast(monkeypatch):
    """Llama's RMSNorm order: the normalised value cast to bf16 first, then times the bf16 weight
    (two roundings where Gemma's one, after the fp32 product)."""

    def norm(x, weight, eps):
        xf = x.float()
        normed = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)
        return normed if weight is None else normed * weight.to(x.dtype)

    monkeypatch.setattr(port_model, "rms_norm", norm)


def softmax_in_bf16(monkeypatch):
    """The attention softmax taken in bf16 (no dtype=float32)."""

    def attention(q, kv, mask, groups):
        b, heads, s, d = q.shape
        k_all, v_all = (t.repeat_interleave(groups, dim=1) for t in kv)
        scores = torch.matmul(q, k_all.transpose(2, 3)) * port_model.attention_scale(d) + mask
        return torch.matmul(F.softmax(scores, dim=-1), v_all).transpose(1, 2).reshape(b, s, heads * d)

    monkeypatch.setattr(port_model, "eager_attention", attention)


def all_reduce_in_bf16(monkeypatch):
    """Row-parallel partial sums added in bf16 (a reduce dtype of bf16: NxD's reduce_dtype), where
    the port adds them in fp32 and rounds once."""

    def all_reduce(self, x):
        parts = self.group.exchange(self.rank, x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    monkeypatch.setattr(port_cpu.RankCollectives, "all_reduce", all_reduce)


# ---- rounding later than the reference (over-precision) -------------------------------------------

def probabilities_kept_fp32(monkeypatch):
    """The attention probabilities not cast to bf16 before P.V: P.V in fp32, cast once after."""

    def attention(q, kv, mask, groups):
        b, heads, s, d = q.shape
        k_all, v_all = (t.repeat_interleave(groups, dim=1) for t in kv)
        scores = torch.matmul(q, k_all.transpose(2, 3)) * port_model.attention_scale(d) + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.matmul(probs, v_all.float()).to(q.dtype).transpose(1, 2).reshape(b, s, heads * d)

    monkeypatch.setattr(port_model, "eager_attention", attention)


def scores_in_fp32(monkeypatch):
    """The attention scores Q.K^T computed in fp32 (an extra .float() on q and k)."""

    def attention(q, kv, mask, groups):
        b, heads, s, d = q.shape
        k_all, v_all = (t.repeat_interleave(groups, dim=1) for t in kv)
        scores = torch.matmul(q.float(), k_all.float().transpose(2, 3)) * port_model.attention_scale(d) + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v_all).transpose(1, 2).reshape(b, s, heads * d)

    monkeypatch.setattr(port_model, "eager_attention", attention)


def mlp_activation_fp32(monkeypatch):
    """gelu(gate) * up in fp32, cast once before down_proj (the reference rounds each)."""

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((F.gelu(gate.float(), approximate="tanh") * up.float()).to(x.dtype))

    monkeypatch.setattr(port_model.MLP, "forward", forward)


def rope_applied_in_fp32(monkeypatch):
    """q and k rotated in fp32 with fp32 cos/sin, cast once after (the reference casts cos/sin and
    rotates in bf16)."""
    monkeypatch.setattr(port_model, "apply_rope", lambda x, cos, sin: (
        x.float() * cos.float().unsqueeze(2) + port_model.rotate_half(x).float() * sin.float().unsqueeze(2)
    ).to(x.dtype))
    real = port_model.rope_cos_sin
    monkeypatch.setattr(port_model, "rope_cos_sin", lambda inv_freq, positions, dtype: real(inv_freq, positions,
                                                                                            torch.float32))


def residual_in_fp32(monkeypatch):
    """The layer's residual adds and its layer scalar in fp32, rounded once at the layer's output
    (the reference rounds after each add and after the scalar)."""

    def forward(self, x, cos, sin, positions, mask, captures=None, prefix=""):
        attn = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, positions, mask))
        h = x.float() + attn.float()
        ffn = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h.to(x.dtype))))
        out = h + ffn.float()
        if captures is not None:
            captures[prefix + "attn_residual"], captures[prefix + "mlp_residual"] = h, out
        return (out * self.layer_scalar.float()).to(x.dtype)

    monkeypatch.setattr(port_model.DecoderLayer, "forward", forward)


def ple_table_scaled_before_cast(monkeypatch):
    """The per-layer table's rows scaled by sqrt(width) in fp32, then cast (the embedding scale's twin)."""
    monkeypatch.setattr(port_engine, "per_layer_rows", lambda table, ids, width: (
        table[ids].float() * width ** 0.5).to(table.dtype))


def ple_projection_scale_missing(monkeypatch):
    """The per-layer model projection not scaled by 1/sqrt(hidden) before its norm: the norm hides it
    except where the projection is small next to the norm's eps (TINY_E2B_SMALL_PROJECTION)."""
    real = port_blocks.PerLayerInputs.__init__

    def init(self, spec):
        real(self, spec)
        self.scale = 1.0

    monkeypatch.setattr(port_blocks.PerLayerInputs, "__init__", init)


# The E2B variant whose per-layer model projection is small next to the norm's eps (its weights
# x PLE_PROJECTION_SHRINK): where a missing projection scale is large (tests/census/cases.py has it).
TINY_E2B_SMALL_PROJECTION = "tiny-e2b-small-projection"
PLE_PROJECTION_SHRINK = 1e-4

PRECISION_CATALOG: list[PrecisionFault] = [
    PrecisionFault("rmsnorm-no-fp32-upcast", "norms", "RMSNorm computed in bf16, not upcast to fp32",
                   rms_norm_without_fp32, "gate", "layers.0.attn_residual", twin="residual-in-fp32"),
    PrecisionFault("rmsnorm-weight-after-cast", "norms", "Llama's order: the normalised value cast to bf16, "
                   "then times the weight in bf16", rms_norm_weight_after_cast, "gate", "layers.0.attn_residual"),
    PrecisionFault("attention-softmax-bf16", "attention", "the attention softmax in bf16",
                   softmax_in_bf16, "gate", "layers.0.attn_residual", twin="attention-probs-fp32"),
    PrecisionFault("all-reduce-bf16", "collectives", "row-parallel partial sums added in bf16, not fp32",
                   all_reduce_in_bf16, "gate", "layers.0.attn_residual"),
    PrecisionFault("attention-probs-fp32", "attention", "the attention probabilities kept in fp32 through P.V",
                   probabilities_kept_fp32, "over", "layers.0.attn_residual", twin="attention-softmax-bf16"),
    PrecisionFault("attention-scores-fp32", "attention", "Q.K^T computed in fp32",
                   scores_in_fp32, "over", "layers.0.attn_residual"),
    PrecisionFault("mlp-activation-fp32", "mlp", "gelu(gate) * up in fp32, cast once before down_proj",
                   mlp_activation_fp32, "over", "layers.0.mlp_residual"),
    PrecisionFault("rope-applied-fp32", "rope", "q and k rotated in fp32 with fp32 cos/sin",
                   rope_applied_in_fp32, "over", "kv.0.k", twin="rope-angles-activation-dtype"),
    PrecisionFault("residual-in-fp32", "residual", "the residual adds and the layer scalar in fp32, one rounding "
                   "at the layer's output", residual_in_fp32, "over", "layers.0.attn_residual",
                   twin="rmsnorm-no-fp32-upcast"),
    PrecisionFault("embed-scale-not-cast", "scales", "sqrt(hidden) applied in fp32 instead of cast to bf16 first",
                   embed_scale_not_cast, "over", "embeddings", TINY_INEXACT_SCALE),
]
BY_NAME = {f.name: f for f in PRECISION_CATALOG}


def distribution_of(result):
    return next(s for s in result.extra_stages if s.stage == "distribution")


def named_point(result, flag: str) -> str | None:
    """Where the verdict says the fault starts: the first over-precise point ("over"), or the first
    point the 4x limit or the distributional gate names ("gate")."""
    dist = distribution_of(result)
    if flag == "over":
        return dist.over_precision[0].point if dist.over_precision else None
    failing = [p for p in result.all_points() if not p.passed]
    if failing:
        return failing[0].name
    named = [b["where"].split(" ")[0] for b in dist.breaches]
    return min(named, key=run_order) if named else None


def run_order(name: str) -> tuple:
    p = Point.parse(name)
    rank = {"embeddings": 0, "layer": 1, "kv": 1, "final_norm": 2, "logits": 3, "probabilities": 4}[p.kind]
    return (p.decode, rank, p.layer if p.layer is not None else -1, p.kind != "kv")


def caught(fault: PrecisionFault, result) -> list[str]:
    """What the verdict misses for `fault` (empty: caught or flagged at its point's layer and part)."""
    missed = []
    if fault.flag == "gate" and result.passed:
        missed.append("fails check")
    point = named_point(result, fault.flag)
    if point is None:
        missed.append("named")
    elif Point.parse(point).layer != Point.parse(fault.point).layer or Point.parse(point).kind != Point.parse(fault.point).kind:
        missed.append(f"point ({point}, expected {fault.point})")
    return missed


def main(argv=None) -> int:
    import tempfile
    from pathlib import Path

    import pytest

    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.prompts import DEFAULT_NEW_TOKENS, load_prompts
    from harness.inputs.tiny import tiny_checkpoint
    from harness.reference.run import run_reference
    from tests.faults.catalog import inexact_scale_checkpoint

    names = set(sys.argv[1:] if argv is None else argv)
    faults = [f for f in PRECISION_CATALOG if not names or f.name in names]

    dirs = {TINY: tiny_checkpoint(seed=0), TINY_INEXACT_SCALE: inexact_scale_checkpoint(Path(tempfile.mkdtemp()))}
    ckpts, refs = {}, {}
    print("| fault | where | rounds | expected | named | cumulative median (worst kind) | local median "
          "(worst kind) | verdict |\n|---|---|---|---|---|---|---|---|")
    for f in faults:
        if f.checkpoint not in ckpts:
            ckpts[f.checkpoint] = Checkpoint.open(dirs[f.checkpoint])
            refs[f.checkpoint] = run_reference(dirs[f.checkpoint], load_prompts(), new_tokens=DEFAULT_NEW_TOKENS)
        with pytest.MonkeyPatch.context() as mp:
            result = run_precision_fault(f, mp, ckpts[f.checkpoint], refs[f.checkpoint])
        dist, missed = distribution_of(result), caught(f, result)
        cells = []
        for scope in ("cumulative", "local"):
            kinds = [s for s in dist.kinds if s.scope == scope and s.gated]
            lo, hi = (min(kinds, key=lambda s: s.median), max(kinds, key=lambda s: s.median)) if kinds else (None, None)
            cells.append(f"{lo.median:.3f} ({lo.kind}) .. {hi.median:.3f} ({hi.kind})" if kinds else "-")
        print(f"| {f.name} | {f.where} | {'earlier' if f.flag == 'gate' else 'later'} | `{f.point}` | "
              f"{named_point(result, f.flag)} | {cells[0]} | {cells[1]} | "
              f"{'caught' if f.flag == 'gate' else 'flagged'}{'' if not missed else ' **gap** ' + ', '.join(missed)} "
              f"(check {'passes' if result.passed else 'fails'}) |", flush=True)
    return 0


def run_precision_fault(fault: PrecisionFault, monkeypatch, ckpt, refs):
    """Inject `fault` and run check (both stages, local verdicts on: the layer-alone distribution)."""
    fault.inject(monkeypatch)
    return run_faulty_check(None, monkeypatch, ckpt, refs, local=True, key=fault.checkpoint)


if __name__ == "__main__":
    sys.exit(main())
