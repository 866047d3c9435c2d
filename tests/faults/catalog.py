"""The fault catalog: port bugs of DESIGN §2 and §3, each injected into the port, each of which the
parity check must fail on, and where it must say so (first divergent layer, capture point, tokens).

Every fault patches the port (harness.model / harness.sharding / harness.engine) through a
pytest MonkeyPatch and never the reference, which is transformers itself: one reference run serves
every fault. `python -m tests.faults.catalog` runs the catalog and prints what caught each fault
as a Markdown table (the one in the README).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from harness import engine as port_engine
from harness import model as port_model
from harness import sharding as port_sharding
from harness.compare import compare_logits

TINY = "tiny0"  # the default tiny fixture (hidden 64)
# A variant whose sqrt(hidden) is not a bf16 number, so that whether the scale is cast first
# changes the embeddings; the default fixture's sqrt(64) = 8 is exact in bf16 and hides it.
TINY_INEXACT_SCALE = "tiny-hidden72"
INEXACT_SCALE_HIDDEN = 72  # sqrt(72) = 8.485 rounds to 8.5 in bf16

CHECK_BUCKETS = (64,)  # every default prompt (7, 24, 40 and 64 tokens) goes to this one bucket
CHECK_KV_LEN = 128


# ---- what a fault must do to the check ----------------------------------------------------------

@dataclass(frozen=True)
class Expectation:
    """Where the check must catch the fault.

    `first_point`: the first capture point (in run order: embeddings, each layer's attn_residual,
    mlp_residual, output, then final_norm) that breaks the policy, or None when none may (a fault
    downstream of the final norm, or in decode only). `first_layer` and `component`: the check's
    first divergent layer and its component (None: no layer diverges). `min_position`: the fault
    cannot change a query before this position of its prompt, so the first failing point's worst
    position must not lie before it. `tokens`: real (not near-tie) token divergences are required.
    The check must fail in every case."""

    first_point: str | None
    first_layer: int | None = None
    component: str | None = None
    min_position: int | None = None
    tokens: bool = False


@dataclass(frozen=True)
class PolicyGap:
    """Expectations (names as `unmet` returns them) the current policy of harness/compare.py and
    harness/parity.py does not meet for a fault, and why. The test requires exactly these to be
    missed, so it fails both when the gap widens and when a policy fix closes it."""

    unmet: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Fault:
    name: str
    design: str  # the DESIGN section whose fact the fault breaks
    description: str
    inject: Callable  # inject(monkeypatch) patches the port
    expect: Expectation
    checkpoint: str = TINY
    gap: PolicyGap | None = None


# ---- injectors ----------------------------------------------------------------------------------

def _after_attention_init(monkeypatch, edit) -> None:
    """Run `edit(attention, layer_spec, plan)` on every Attention the port builds from now on."""
    original = port_model.Attention.__init__

    def init(self, spec, layer, plan, linears, max_len, dtype):
        original(self, spec, layer, plan, linears, max_len, dtype)
        edit(self, layer, plan)

    monkeypatch.setattr(port_model.Attention, "__init__", init)


def repeat_not_interleave(monkeypatch):
    """Query head j reads KV head j % kv_heads (`repeat`) instead of j // groups (`repeat_interleave`).
    With one KV head per rank (full layers) both are the same, so only sliding layers show it."""

    def edit(attn, layer, plan):
        if plan.kv_heads_per_rank == 1:
            return
        groups, attn.groups = attn.groups, 1  # the port's repeat_interleave becomes a no-op
        update = attn.cache.update

        def tiled_update(positions, k, v):
            k_all, v_all = update(positions, k, v)
            return k_all.repeat(1, groups, 1, 1), v_all.repeat(1, groups, 1, 1)

        attn.cache.update = tiled_update

    _after_attention_init(monkeypatch, edit)


def split_single_kv_head(monkeypatch):
    """The one KV head of full layers column-split over ranks (each rank half of its head_dim),
    gathered after k_norm/v_norm: each half is normalized by its own half's RMS."""

    def per_rank_pieces(norm, tp, x):
        weights = norm.weight.chunk(tp) if norm.weight is not None else [None] * tp
        return torch.cat([port_model.rms_norm(piece, w, norm.eps)
                          for piece, w in zip(x.chunk(tp, -1), weights)], -1)

    def edit(attn, layer, plan):
        if plan.kv_layout != "replicate":
            return
        for norm in (attn.k_norm, attn.v_norm):
            norm.forward = lambda x, norm=norm: per_rank_pieces(norm, plan.tp, x)

    _after_attention_init(monkeypatch, edit)


def kv_heads_of_other_rank(monkeypatch):
    """Sharded KV heads (sliding layers) loaded for rank tp-1-r: each rank's queries read the other
    rank's keys and values."""
    original = port_sharding.kv_heads_for_rank

    def swapped(plan, rank):
        return original(plan, plan.tp - 1 - rank if plan.kv_layout == "shard" else rank)

    monkeypatch.setattr(port_sharding, "kv_heads_for_rank", swapped)


def one_plus_weight_rms_norm(monkeypatch):
    original = port_model.rms_norm
    monkeypatch.setattr(port_model, "rms_norm",
                        lambda x, weight, eps: original(x, None if weight is None else 1.0 + weight.float(), eps))


def rms_norm_without_fp32(monkeypatch):
    """RMSNorm computed in the activation dtype (bf16) instead of upcast to fp32."""

    def bf16_rms_norm(x, weight, eps):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return normed if weight is None else normed * weight.to(x.dtype)

    monkeypatch.setattr(port_model, "rms_norm", bf16_rms_norm)


def inverse_sqrt_scale(monkeypatch):
    monkeypatch.setattr(port_model, "attention_scale", lambda head_dim: head_dim ** -0.5)


def missing_v_norm(monkeypatch):
    def edit(attn, layer, plan):
        attn.v_norm = nn.Identity()  # v_norm has no weight: the state dict is unchanged

    _after_attention_init(monkeypatch, edit)


def value_after_k_norm(monkeypatch):
    """Full layers (k_eq_v) take the value from k_norm's output instead of the raw k_proj output."""

    def edit(attn, layer, plan):
        if not layer.k_eq_v:
            return
        k_norm, v_norm = attn.k_norm, attn.v_norm
        v_norm.forward = lambda x: port_model.rms_norm(k_norm(x), None, v_norm.eps)

    _after_attention_init(monkeypatch, edit)


def full_rotary_on_full_layers(monkeypatch):
    """Every frequency of full layers rotates (default rope) instead of the proportional 25 %."""
    original = port_model.rope_inv_freq
    monkeypatch.setattr(port_model, "rope_inv_freq", lambda layer: original(
        layer if layer.rope_type != "proportional" else dataclasses.replace(layer, rope_type="default")))


def proportional_over_rotated_width(monkeypatch):
    """inv_freq[i] = theta ** (-2i / rotated_width) instead of theta ** (-2i / head_dim)."""
    original = port_model.rope_inv_freq

    def inv_freq(layer):
        if layer.rope_type != "proportional":
            return original(layer)
        n = layer.rotated_freqs
        rotated = 1.0 / layer.rope_theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float) / (2 * n))
        return torch.cat([rotated, torch.zeros(layer.head_dim // 2 - n)])

    monkeypatch.setattr(port_model, "rope_inv_freq", inv_freq)


def rope_interleaved_pairs(monkeypatch):
    """GPT-J style rotation (lane 2i with 2i+1) instead of rotate-half (lane i with i + D/2)."""

    def rotate_pairs(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    monkeypatch.setattr(port_model, "rotate_half", rotate_pairs)


def _window_changed(monkeypatch, change) -> None:
    original = port_model.attention_mask
    monkeypatch.setattr(port_model, "attention_mask", lambda positions, kv_len, window, dtype: original(
        positions, kv_len, None if window is None else change(window), dtype))


def window_one_too_wide(monkeypatch):
    _window_changed(monkeypatch, lambda w: w + 1)


def window_one_too_narrow(monkeypatch):
    _window_changed(monkeypatch, lambda w: w - 1)


def sliding_layers_plain_causal(monkeypatch):
    _window_changed(monkeypatch, lambda w: None)


def layer_scalar_not_loaded(monkeypatch):
    """The loader drops the `[1]` layer_scalar buffer, which stays at its init value 1.0."""
    original = port_sharding.shard_layer

    def shard_layer(weights, plan, rank):
        out = original(weights, plan, rank)
        out["layer_scalar"] = torch.ones_like(out["layer_scalar"])
        return out

    monkeypatch.setattr(port_sharding, "shard_layer", shard_layer)


def softcap_on_device(monkeypatch):
    """The device graph caps its logits (in its dtype) and the host caps them again."""
    original = port_model.RankDecoder.forward

    def forward(self, inputs_embeds, positions, capture=False):
        out = original(self, inputs_embeds, positions, capture)
        logits, captures = out if capture else (out, None)
        cap = self.spec.final_logit_softcapping
        capped = cap * torch.tanh(logits / cap)
        return (capped, captures) if capture else capped

    monkeypatch.setattr(port_model.RankDecoder, "forward", forward)


def embed_scale_not_cast(monkeypatch):
    monkeypatch.setattr(port_engine, "embed_scale", lambda hidden, dtype: torch.tensor(hidden ** 0.5))


def decode_from_bucket_length(monkeypatch):
    """Decode continues at the padded length (the bucket) instead of the prompt length: the pad
    tokens' keys, written by prefill, sit in the cache before the new tokens and are attended."""
    prefill, decode_step = port_engine.Engine.prefill, port_engine.Engine.decode_step

    def padded_prefill(self, ids, capture=False):
        result = prefill(self, ids, capture)
        self.padding = result.bucket - result.logits.shape[0]
        return result

    def late_decode_step(self, token, position):
        return decode_step(self, token, position + self.padding)

    monkeypatch.setattr(port_engine.Engine, "prefill", padded_prefill)
    monkeypatch.setattr(port_engine.Engine, "decode_step", late_decode_step)


# ---- the catalog --------------------------------------------------------------------------------

FIRST_FULL = 5  # the tiny fixture's first full-attention layer (full layers 5 and 11)
WINDOW = 16  # the tiny fixture's sliding window; the default prompts of 24, 40 and 64 tokens cross it
LOCATION = ("first point", "first layer", "component")


def _attn(layer: int) -> str:
    return f"layers.{layer}.attn_residual"


CATALOG: list[Fault] = [
    Fault("kv-repeat-not-interleave", "§3 fix 1",
          "query heads mapped to KV heads with repeat (j % nkv) instead of repeat_interleave "
          "(j // groups); identical at one KV head per rank, so only sliding layers break",
          repeat_not_interleave, Expectation(_attn(0), 0, "attention")),
    Fault("single-kv-head-split", "§3 fix 1",
          "the one KV head of full layers split over ranks by head_dim halves instead of "
          "replicated: k_norm and v_norm each see half a head",
          split_single_kv_head, Expectation(_attn(FIRST_FULL), FIRST_FULL, "attention"),
          gap=PolicyGap(("first point",),
                        "cumulative errors only: layer 5 adds about twice the bf16 error accumulated "
                        "over layers 0-4, so the port's own run stays under ENVELOPE_FACTOR at every "
                        "point; the check's local verdict (layer 5 alone on the reference's input, "
                        "about 16x) names layer 5 attention")),
    Fault("kv-heads-wrong-rank", "§3 fix 1",
          "sliding layers' sharded KV heads loaded on the wrong rank (rank r gets rank 1-r's)",
          kv_heads_of_other_rank, Expectation(_attn(0), 0, "attention")),
    Fault("rmsnorm-one-plus-weight", "§2.1", "RMSNorm multiplies by 1 + weight",
          one_plus_weight_rms_norm, Expectation(_attn(0), 0, "attention")),
    Fault("rmsnorm-no-fp32-upcast", "§2.1", "RMSNorm computed in bf16, not upcast to fp32",
          rms_norm_without_fp32, Expectation(_attn(0), 0, "attention"),
          gap=PolicyGap(("fails check",) + LOCATION,
                        "inside bf16 noise on CPU (every point at most ~1.3x the envelope, bisect's "
                        "local ratios too): CPU bf16 reductions accumulate in fp32, so the missing "
                        "upcast adds only a few bf16 roundings per norm. No envelope policy can see "
                        "it here; the bitwise unit check in tests/unit/test_model.py catches it "
                        "(test_rmsnorm_upcast_fault_caught_by_unit_check)")),
    Fault("attention-inverse-sqrt-scale", "§2.2", "attention scores scaled by 1/sqrt(head_dim), not 1.0",
          inverse_sqrt_scale, Expectation(_attn(0), 0, "attention")),
    Fault("missing-v-norm", "§2.3", "the weightless v_norm left out",
          missing_v_norm, Expectation(_attn(0), 0, "attention")),
    Fault("value-after-k-norm", "§2.3",
          "full layers (k_eq_v) take the value after k_norm instead of the raw k_proj output",
          value_after_k_norm, Expectation(_attn(FIRST_FULL), FIRST_FULL, "attention")),
    Fault("full-rotary-on-full-layers", "§2.4",
          "full layers rotate every frequency instead of the proportional 25 %",
          full_rotary_on_full_layers, Expectation(_attn(FIRST_FULL), FIRST_FULL, "attention"),
          gap=PolicyGap(("first point",),
                        "the tiny fixture's positions reach 71 only: at head_dim 32 and theta 1e6 the "
                        "frequencies this fault adds turn a few radians, so the port's own run stays "
                        "under 4x the envelope at every point; the check's local verdict (layer 5 "
                        "alone on the reference's input) names layer 5 attention")),
    Fault("proportional-over-rotated-width", "§2.4",
          "proportional inv_freq exponent divided by the rotated width, not the full head_dim",
          proportional_over_rotated_width, Expectation(_attn(FIRST_FULL), FIRST_FULL, "attention")),
    Fault("rope-interleaved-pairs", "§2.4", "rope rotates lanes 2i, 2i+1 instead of i, i + D/2",
          rope_interleaved_pairs, Expectation(_attn(0), 0, "attention")),
    Fault("window-one-too-wide", "§2.8", "sliding mask keeps window + 1 keys (i - W <= j)",
          window_one_too_wide, Expectation(_attn(0), 0, "attention", min_position=WINDOW)),
    Fault("window-one-too-narrow", "§2.8", "sliding mask keeps window - 1 keys",
          window_one_too_narrow, Expectation(_attn(0), 0, "attention", min_position=WINDOW - 1)),
    Fault("sliding-layers-causal", "§2.8", "sliding layers get the plain causal mask (no window)",
          sliding_layers_plain_causal, Expectation(_attn(0), 0, "attention", min_position=WINDOW)),
    Fault("layer-scalar-missing", "§2.5",
          "layer_scalar not loaded (left at 1.0): the residuals are right, the layer output is not",
          layer_scalar_not_loaded, Expectation("layers.0.output", 0, "mlp")),
    Fault("softcap-twice", "§3 fix 2",
          "the device graph returns capped logits and the host caps them again; every hidden-state "
          "capture point is upstream of the logits, so only the logits point can show it",
          softcap_on_device, Expectation("logits")),
    Fault("embed-scale-not-cast", "§2.7",
          "sqrt(hidden) applied in fp32 instead of cast to bf16 first; a no-op on the default "
          "fixture (sqrt(64) = 8 is exact in bf16), so run on a hidden-72 variant. An envelope "
          "anchored on fp32 cannot see it (the fault moves bf16 toward fp32); the embeddings' "
          "bit-exactness with the bf16 reference does",
          embed_scale_not_cast, Expectation("embeddings"), checkpoint=TINY_INEXACT_SCALE),
    Fault("decode-from-bucket-length", "§3 buckets",
          "decode continues at the bucket length: padded keys leak into every decode step",
          decode_from_bucket_length, Expectation("decode_logits", tokens=True)),
]

BY_NAME = {fault.name: fault for fault in CATALOG}


# ---- running a fault and reading what caught it -------------------------------------------------

def run_faulty_check(fault: Fault | None, monkeypatch, checkpoint, references):
    """Inject `fault` (None: the clean port), build the port (TP=2, bf16, CPU) and run the parity
    check against the references (fp32 and bf16) computed once for the checkpoint."""
    from harness.backends import build_engine
    from harness.parity import check_port

    if fault is not None:
        fault.inject(monkeypatch)
    engine = build_engine(checkpoint, tp=2, dtype=torch.bfloat16, buckets=CHECK_BUCKETS, kv_len=CHECK_KV_LEN)
    return check_port(checkpoint, engine, references["float32"], references["bfloat16"])


def failing_points(result) -> list:
    """Every capture point that broke the policy, in run order (embeddings that are within the
    envelope but not bit-exact with the same-dtype reference count as failing)."""
    points = [result.embeddings] + [p for layer in result.layers for p in layer.points] + [result.final_norm]
    points += [p for p in (result.logits, result.decode_logits) if p is not None]
    failing = [p for p in points if not p.passed]
    if not result.embeddings_exact and result.embeddings not in failing:
        failing.insert(0, result.embeddings)
    return failing


def prompt_position(stacked_row: int, prompt_lengths: list[int]) -> int:
    """Position inside its prompt of a row of the prompts' stacked captures."""
    for length in prompt_lengths:
        if stacked_row < length:
            return stacked_row
        stacked_row -= length
    raise IndexError(f"row {stacked_row} is past the last of prompts of lengths {prompt_lengths}")


def reference_kl(references, spec) -> float:
    """The bf16 reference's own worst KL against fp32 (prefill and decode): the KL noise floor."""
    cap = spec.final_logit_softcapping
    worst = 0.0
    for r32, r16 in zip(references["float32"], references["bfloat16"]):
        for dev, ref in ((r16.captures["logits"], r32.captures["logits"]), (r16.step_logits, r32.step_logits)):
            worst = max(worst, compare_logits(dev, ref, None, cap).kl_max)
    return worst


@dataclass
class Caught:
    """What the check reported for one fault, in the terms of Expectation and the table."""

    passed: bool
    first_point: str | None
    first_point_factor: float | None  # the ENVELOPE_FACTOR that would have passed it
    first_layer: int | None
    component: str | None
    worst_position: int | None  # in its prompt, for the first failing point
    divergences: int
    near_ties: int
    seq_match: bool
    kl_max: float

    @classmethod
    def of(cls, result) -> "Caught":
        failing = failing_points(result)
        first = failing[0] if failing else None
        lengths = [len(p.prompt) for p in result.prompts]
        layer = result.first_divergent_layer
        return cls(
            passed=result.passed, first_point=first.name if first else None,
            first_point_factor=first.required_factor if first else None,
            first_layer=layer, component=result.first_divergent_component,
            worst_position=prompt_position(first.worst_position, lengths) if first else None,
            divergences=result.divergences, near_ties=result.near_ties, seq_match=result.seq_match,
            kl_max=max(max(p.prefill.kl_max, p.decode.kl_max) for p in result.prompts),
        )

    def caught_by(self) -> str:
        if self.passed:
            return "**not caught** (check passes)"
        parts = []
        if self.first_layer is not None:
            parts.append(f"layer {self.first_layer} ({self.component})")
        if self.first_point is not None:
            parts.append(f"`{self.first_point}` {self.first_point_factor:.0f}x envelope")
        if self.divergences:
            parts.append(f"{self.divergences} real token divergence{'s' if self.divergences > 1 else ''}")
        return ", ".join(parts)


def unmet(expect: Expectation, caught: Caught) -> list[str]:
    """The expectations the check's report does not meet (empty: caught as and where expected)."""
    missed = []
    if caught.passed:
        missed.append("fails check")
    if caught.first_point != expect.first_point:
        missed.append("first point")
    if caught.first_layer != expect.first_layer:
        missed.append("first layer")
    if caught.component != expect.component:
        missed.append("component")
    if expect.min_position is not None and (caught.worst_position is None
                                            or caught.worst_position < expect.min_position):
        missed.append("position")
    if expect.tokens and caught.divergences == 0:
        missed.append("tokens")
    return missed


TABLE_HEADER = (
    "| # | fault | DESIGN | expected | caught by (`gemma-parity check`) | worst position | "
    "SEQ_MATCH, real / near-tie flips | max KL (tiny0's bf16 reference: {floor:.2f}) | verdict |\n"
    "|---|---|---|---|---|---|---|---|---|")


def _expected(expect: Expectation) -> str:
    where = f"`{expect.first_point}`" if expect.first_point else "no capture point"
    if expect.min_position is not None:
        where += f", position >= {expect.min_position}"
    return where + (", tokens" if expect.tokens else "")


def table_row(k: int, fault: Fault, caught: Caught) -> str:
    missed = unmet(fault.expect, caught)
    verdict = "caught" if not missed else "**gap**: misses " + ", ".join(missed)
    position = "" if caught.worst_position is None else str(caught.worst_position)
    tokens = f"{'yes' if caught.seq_match else 'no'}, {caught.divergences} / {caught.near_ties}"
    return (f"| {k} | {fault.name} | {fault.design} | {_expected(fault.expect)} | {caught.caught_by()} "
            f"| {position} | {tokens} | {caught.kl_max:.2f} | {verdict} |")


def inexact_scale_checkpoint(out_dir):
    """The tiny config with a hidden size whose sqrt is inexact in bf16, built into `out_dir`."""
    import json

    from harness.checkpoint import TINY_CONFIG, build_tiny_checkpoint

    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"]["hidden_size"] = INEXACT_SCALE_HIDDEN
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / f"gemma-4-tiny-hidden{INEXACT_SCALE_HIDDEN}.json"
    config_path.write_text(json.dumps(config))
    return build_tiny_checkpoint(out_dir / "checkpoint", seed=0, config_path=config_path)


def main(argv=None) -> int:
    """Run the catalog (or the faults named on the command line) and print the Markdown table."""
    import tempfile
    from pathlib import Path

    import pytest

    from harness.checkpoint import Checkpoint, tiny_checkpoint
    from harness.prompts import DEFAULT_NEW_TOKENS, load_prompts
    from harness.reference import run_reference

    names = set(sys.argv[1:] if argv is None else argv)
    unknown = names - set(BY_NAME)
    if unknown:
        print(f"unknown faults {sorted(unknown)}; the catalog has {sorted(BY_NAME)}", file=sys.stderr)
        return 2
    faults = [(k, f) for k, f in enumerate(CATALOG, 1) if not names or f.name in names]
    prompts = load_prompts()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {TINY: tiny_checkpoint(seed=0)}
        if any(f.checkpoint == TINY_INEXACT_SCALE for _, f in faults):
            dirs[TINY_INEXACT_SCALE] = inexact_scale_checkpoint(Path(tmp))
        ckpts = {key: Checkpoint.open(d) for key, d in dirs.items()}
        refs = {key: run_reference(d, prompts, new_tokens=DEFAULT_NEW_TOKENS) for key, d in dirs.items()}
        print(TABLE_HEADER.format(floor=reference_kl(refs[TINY], ckpts[TINY].spec)))
        for k, fault in faults:
            with pytest.MonkeyPatch.context() as mp:
                result = run_faulty_check(fault, mp, ckpts[fault.checkpoint], refs[fault.checkpoint])
            print(table_row(k, fault, Caught.of(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
