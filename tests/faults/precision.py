"""Precision-ordering faults (issue 38): a rounding to bf16 earlier than the reference does it (the
port less precise: R's median rises above 1 at every position, the distributional gate of
harness/judge/distribution.py fails it) or later (an extra fp32 stretch: R's median drops below 1,
over-precision, harness/judge/precision.py flags it). Each is the kind of bug AWS's equivalence
table names ("precision ordering or missing multiplier", "over-precision"), in norms, attention,
the MLP, the residual and layer scalar, rope and the scales, each injected into the port only.
`python -m tests.faults.precision` prints what caught each (the table in docs/faults.md)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

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
    rounds: str | None = None  # "earlier" or "later" where the flag does not say it (a later rounding failing check)
    # Why the judge cannot see it at the fixture's size, with the numbers; the test requires exactly
    # a miss (so a sharper judge fails it until the record is updated)
    gap: str | None = None


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
    """The attention softmax's exponentials, sum and division each rounded to bf16 (a device lowering
    in the activation dtype; torch's own bf16 softmax on CPU computes in fp32 and rounds once, the
    same as the reference, so it is spelled out)."""

    def attention(q, kv, mask, groups):
        b, heads, s, d = q.shape
        k_all, v_all = (t.repeat_interleave(groups, dim=1) for t in kv)
        scores = torch.matmul(q, k_all.transpose(2, 3)) * port_model.attention_scale(d) + mask
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        probs = e / e.sum(-1, keepdim=True)
        return torch.matmul(probs, v_all).transpose(1, 2).reshape(b, s, heads * d)

    monkeypatch.setattr(port_model, "eager_attention", attention)


def gelu_in_bf16_steps(monkeypatch):
    """The MLP's tanh GELU spelled out in bf16, each step rounded (torch's fused bf16 GELU on CPU
    computes in fp32 and rounds once, as the reference does)."""

    def forward(self, x):
        g = self.gate_proj(x)
        inner = (g + 0.044715 * g * g * g) * 0.7978845608028654
        return self.down_proj(0.5 * g * (1.0 + torch.tanh(inner)) * self.up_proj(x))

    monkeypatch.setattr(port_model.MLP, "forward", forward)


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


def ple_gate_in_fp32(monkeypatch):
    """The per-layer input's gate, gelu(gate(h)) * per_layer_input, computed in fp32 and cast once
    before its projection (the reference rounds the gate's output, the activation and the product)."""

    def forward(self, x, cos, sin, positions, mask, captures=None, prefix="", per_layer_input=None):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, positions, mask))
        out = h + self.post_feedforward_layernorm(self.feed_forward(h, captures, prefix))
        if captures is not None:
            captures[prefix + "attn_residual"], captures[prefix + "mlp_residual"] = h, out
        gated = (F.gelu(self.per_layer_input_gate(out).float(), approximate="tanh") * per_layer_input.float()).to(out.dtype)
        if captures is not None:
            captures[prefix + "per_layer_input"] = gated
        out = out + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return out * self.layer_scalar.to(out.dtype)

    monkeypatch.setattr(port_blocks.FamilyDecoderLayer, "forward", forward)


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

TINY_E2B = "tiny-e2b"
PRECISION_CATALOG: list[PrecisionFault] = [
    PrecisionFault("rmsnorm-no-fp32-upcast", "norms", "RMSNorm computed in bf16, not upcast to fp32",
                   rms_norm_without_fp32, "gate", "layers.0.attn_residual", twin="residual-in-fp32"),
    PrecisionFault("rmsnorm-weight-after-cast", "norms", "Llama's order: the normalised value cast to bf16, "
                   "then times the weight in bf16", rms_norm_weight_after_cast, "gate", "layers.0.attn_residual"),
    PrecisionFault("attention-softmax-bf16", "attention", "the attention softmax's exponentials, sum and "
                   "division each rounded to bf16", softmax_in_bf16, "gate", "layers.0.attn_residual",
                   twin="attention-probs-fp32"),
    PrecisionFault("mlp-gelu-bf16-steps", "mlp", "the MLP's tanh GELU spelled out in bf16, each step rounded",
                   gelu_in_bf16_steps, "gate", "layers.0.mlp_residual", twin="mlp-activation-fp32"),
    PrecisionFault("attention-probs-fp32", "attention", "the attention probabilities kept in fp32 through P.V",
                   probabilities_kept_fp32, "over", "layers.0.attn_residual", twin="attention-softmax-bf16"),
    PrecisionFault("attention-scores-fp32", "attention", "Q.K^T computed in fp32",
                   scores_in_fp32, "over", "layers.0.attn_residual"),
    PrecisionFault("mlp-activation-fp32", "mlp", "gelu(gate) * up in fp32, cast once before down_proj",
                   mlp_activation_fp32, "over", "layers.0.mlp_residual", twin="mlp-gelu-bf16-steps"),
    PrecisionFault("rope-applied-fp32", "rope", "q and k rotated in fp32 with fp32 cos/sin",
                   rope_applied_in_fp32, "over", "kv.0.k", twin="rope-angles-activation-dtype"),
    PrecisionFault("residual-in-fp32", "residual", "the residual adds and the layer scalar in fp32, one rounding "
                   "at the layer's output", residual_in_fp32, "over", "layers.0.attn_residual",
                   twin="rmsnorm-no-fp32-upcast"),
    PrecisionFault("embed-scale-not-cast", "scales", "sqrt(hidden) applied in fp32 instead of cast to bf16 first",
                   embed_scale_not_cast, "over", "embeddings", TINY_INEXACT_SCALE),
    PrecisionFault("ple-table-scaled-before-cast", "scales", "the per-layer table's rows scaled by "
                   "sqrt(per_layer_input) in fp32, then cast (the embedding scale's twin)",
                   ple_table_scaled_before_cast, "host", "per-layer table rows", TINY_E2B),
    PrecisionFault("ple-gate-fp32", "scales", "the per-layer input's gate and product in fp32, cast once before "
                   "its projection (a later rounding of a small part of the output: the bit-exact layers fail it)",
                   ple_gate_in_fp32, "gate", "layers.0.output", TINY_E2B, rounds="later"),
    PrecisionFault("ple-projection-scale-missing", "scales", "the per-layer model projection not scaled by "
                   "1/sqrt(hidden) before its norm (a missing multiplier the norm hides unless the projection is "
                   "small next to eps)", ple_projection_scale_missing, "gate", "layers.0.per_layer_input",
                   TINY_E2B_SMALL_PROJECTION),
]
BY_NAME = {f.name: f for f in PRECISION_CATALOG}


def distribution_of(result):
    return next(s for s in result.extra_stages if s.stage == "distribution")


def named_point(result, flag: str) -> str | None:
    """Where the verdict says the fault starts: the first over-precise point ("over": R's or the bit-exact
    layers'); else the first point either stage fails, the distributional gate names, or a further stage
    names (the bit-exact layers, the per-layer rows)."""
    dist = distribution_of(result)
    if flag == "over":
        return dist.flagged[0].point if dist.flagged else None
    for stage in (result.bf16, result.fp32):
        failing = [p for p in stage.all_points() if not p.passed] if stage is not None else []
        if failing:
            return failing[0].name
    named = [b["where"].split(" ")[0] for b in dist.breaches]
    if named:
        return min(named, key=run_order)
    return next((f["point"] for s in result.extra_stages for f in s.failures()), None)


def run_order(name: str) -> tuple:
    p = Point.parse(name)
    rank = {"embeddings": 0, "layer": 1, "kv": 1, "final_norm": 2, "logits": 3, "probabilities": 4}[p.kind]
    return (p.decode, rank, p.layer if p.layer is not None else -1, p.kind != "kv")


def same_place(named: str, expected: str) -> bool:
    """The same layer and part kind (a layer's KV point and its attention residual are one place:
    attention), or the same name outside the capture points."""
    try:
        a, b = Point.parse(named), Point.parse(expected)
    except ValueError:
        return named == expected
    return a.layer == b.layer and a.in_layer == b.in_layer and (a.kind == b.kind or a.in_layer)


def caught(fault: PrecisionFault, result) -> list[str]:
    """What the verdict misses for `fault` (empty: caught or flagged at its point's layer)."""
    missed = []
    if fault.flag != "over" and result.passed:
        missed.append("fails check")
    point = named_point(result, fault.flag)
    if point is None:
        missed.append("named")
    elif not same_place(point, fault.point):
        missed.append(f"point ({point}, expected {fault.point})")
    return missed


def main(argv=None) -> int:
    import pytest

    names = set(sys.argv[1:] if argv is None else argv)
    print("| fault | where | rounds | expected | named | cumulative median (kinds) | local median (kinds) | bit-exact "
          "layers (start: elements departing, their median R) | verdict |\n|---|---|---|---|---|---|---|---|---|")
    for f in [f for f in PRECISION_CATALOG if not names or f.name in names]:
        with pytest.MonkeyPatch.context() as mp:
            result = run_precision_fault(f, mp)
        print(table_row(f, result), flush=True)
    return 0


def table_row(f: PrecisionFault, result) -> str:
    dist, missed = distribution_of(result), caught(f, result)
    cells = []
    for scope in ("cumulative", "local"):
        kinds = sorted((s for s in dist.kinds if s.scope == scope and s.gated), key=lambda s: s.median)
        cells.append(f"{kinds[0].median:.3f} ({kinds[0].kind}) .. {kinds[-1].median:.3f} ({kinds[-1].kind})"
                     if kinds else "-")
    rounds = f.rounds or {"gate": "earlier", "over": "later", "host": "later"}[f.flag]
    verdict = ("flagged" if f.flag == "over" else "caught") if not missed else "**gap**: misses " + ", ".join(missed)
    return (f"| {f.name} | {f.where} | {rounds} | `{f.point}` | {named_point(result, f.flag)} | {cells[0]} | "
            f"{cells[1]} | {bitwise_cell(result)} | {verdict} (check {'passes' if result.passed else 'fails'}) |")


def bitwise_cell(result) -> str:
    """Where the bit-exact layer stage (harness/judge/bitwise.py) sees the departure start: its first
    layer's starting point, the share of its elements departing, their median R, and what the stage
    does with it (which way is read over every layer where the part departs first)."""
    stage = next((s for s in result.extra_stages if s.stage == "bitwise_layers"), None)
    if stage is None or not stage.points:
        return "-"
    starts = stage.starts()
    if not starts:
        return f"bit-exact ({len(stage.points)} points)"
    p, later = starts[0]
    way = "later: flagged" if later else "earlier: fails" if p.departing_r > 1 else "about as precise: fails"
    return f"{p.name}: {p.fraction:.1%}, R {p.departing_r:.3f} ({way})"


@functools.lru_cache(maxsize=None)
def fixture(key: str):
    """(checkpoint, references) of a fixture key, built once per process."""
    import tempfile
    from pathlib import Path

    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.prompts import DEFAULT_NEW_TOKENS, load_prompts
    from harness.inputs.tiny import tiny_checkpoint
    from harness.reference.run import run_reference
    from tests.faults.catalog import inexact_scale_checkpoint
    from tests.family.shared import family_checkpoint, family_reference

    if key == TINY_E2B:
        return family_checkpoint("e2b"), family_reference("e2b")
    if key == TINY_E2B_SMALL_PROJECTION:
        return None, None  # a census member: tests/census/ports.py builds and references it
    path = tiny_checkpoint(seed=0) if key == TINY else inexact_scale_checkpoint(Path(tempfile.mkdtemp()))
    return Checkpoint.open(path), run_reference(path, load_prompts(), new_tokens=DEFAULT_NEW_TOKENS)


def run_precision_fault(fault: PrecisionFault, monkeypatch, ckpt=None, refs=None):
    """Inject `fault` and run check on its fixture: both stages and the local phase (the local verdicts
    where the layers run alone, the bit-exact layers), as `check` runs it on the CPU backend."""
    from tests.census.cases import E2B_SMALL_PROJECTION
    from tests.census.ports import run_check

    if ckpt is None:
        ckpt, refs = fixture(fault.checkpoint)
    if fault.checkpoint == TINY_E2B_SMALL_PROJECTION:
        fault.inject(monkeypatch)
        return run_check(E2B_SMALL_PROJECTION.shape, E2B_SMALL_PROJECTION.run)
    if fault.checkpoint == TINY_E2B:  # the family's check with the local phase (the bit-exact layers run in it)
        from harness.backends import build_engine
        from harness.base.settings import RunSettings
        from harness.parity.check import check_port
        from tests.faults.catalog import FAMILY_BUCKETS, FAMILY_KV_LEN

        fault.inject(monkeypatch)
        engine = build_engine(ckpt, RunSettings(tp=2, buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN))
        return check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=True)
    fault.inject(monkeypatch)
    return run_faulty_check(None, monkeypatch, ckpt, refs, local=True, key=fault.checkpoint)


if __name__ == "__main__":
    sys.exit(main())
