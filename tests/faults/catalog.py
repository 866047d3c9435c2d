"""The fault catalog: port bugs of docs/design.md (the model's traps and the port's changes), each
injected into the port, each of which the parity check must fail on, and where it must say so
(first divergent layer, capture point, tokens).

Every fault patches the port (harness.port.model / harness.port.sharding / harness.port.engine) through a
pytest MonkeyPatch and never the reference, which is transformers itself: one reference run serves
every fault. `python -m tests.faults.catalog` runs the catalog and prints what caught each fault
as a Markdown table (the one in docs/faults.md).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from harness.backends import cpu as port_cpu
from harness.base.settings import RunSettings
from harness.judge.tokens import compare_logits
from harness.port import blocks as port_blocks
from harness.port import decode as port_decode
from harness.port import engine as port_engine
from harness.port import kv_cache as port_kv
from harness.port import model as port_model
from harness.port import sharding as port_sharding

TINY = "tiny0"  # the default tiny fixture (hidden 64)
# A variant whose sqrt(hidden) is not a bf16 number, so that whether the scale is cast first
# changes the embeddings; the default fixture's sqrt(64) = 8 is exact in bf16 and hides it.
TINY_INEXACT_SCALE = "tiny-hidden72"
INEXACT_SCALE_HIDDEN = 72  # sqrt(72) = 8.485 rounds to 8.5 in bf16

# The long-context fixture: the tiny config at window 8 with the ring cache, prompts of 2-4 windows
# (fixtures/prompts/long-window8.json) prefilled in chunks of 12 and 4, 8 new tokens past the window.
LONG = "tiny-window8-long"
LONG_WINDOW = 8
LONG_BUCKETS = (4, 12)
LONG_KV_LEN = 48
LONG_NEW_TOKENS = 8
LONG_PROMPTS = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "long-window8.json"
ENGINE_OPTIONS = {LONG: {"buckets": LONG_BUCKETS, "kv_len": LONG_KV_LEN, "sliding_cache": "ring"}}

CHECK_BUCKETS = (64, 256)  # the default prompts: 7, 24, 40 and 64 tokens in 64, the 240-token one in 256
CHECK_KV_LEN = 288  # room past the largest bucket: a decode that starts at the bucket length still runs


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
    # The stages that must fail ("fp32": the structural stage, "bf16": the envelope stage), and the
    # first point the fp32 stage fails at (None: it must pass; "-": not asserted).
    stages: tuple[str, ...] = ("fp32", "bf16")
    fp32_point: str | None = "-"


@dataclass(frozen=True)
class PolicyGap:
    """Expectations (names as `unmet` returns them) the current policy of harness/judge/compare.py and
    harness/parity/check.py does not meet for a fault, and why. The test requires exactly these to be
    missed, so it fails both when the gap widens and when a policy fix closes it."""

    unmet: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Fault:
    name: str
    design: str  # what of docs/design.md the fault breaks: "trap N" (the model's traps) or "port: ..."
    description: str
    inject: Callable  # inject(monkeypatch) patches the port
    expect: Expectation
    checkpoint: str = TINY
    gap: PolicyGap | None = None
    # Run the check's local verdicts (each layer alone on the reference's input) for this fault:
    # where the expectation depends on them. Elsewhere the suite skips them to stay fast.
    local: bool = False


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
        if plan.kv_heads_per_rank > 1:
            attn.groups = 1  # the port's repeat_interleave becomes a no-op; the cache read tiles instead

    _after_attention_init(monkeypatch, edit)
    real_make_cache = port_model.make_cache

    def make_cache(kind, layer, kv_heads, max_len, dtype, **slots):  # the decoder gives each layer its cache
        cache = real_make_cache(kind, layer, kv_heads, max_len, dtype, **slots)
        if kv_heads > 1:
            groups, update = layer.q_heads // layer.kv_heads, cache.update

            def tiled_update(positions, k, v, *args, **kwargs):
                k_all, v_all = update(positions, k, v, *args, **kwargs)
                return k_all.repeat(1, groups, 1, 1), v_all.repeat(1, groups, 1, 1)

            cache.update = tiled_update
        return cache

    monkeypatch.setattr(port_model, "make_cache", make_cache)


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
    monkeypatch.setattr(port_model, "rope_inv_freq", lambda layer, device=None: original(
        layer if layer.rope_type != "proportional" else dataclasses.replace(layer, rope_type="default"), device))


def proportional_over_rotated_width(monkeypatch):
    """inv_freq[i] = theta ** (-2i / rotated_width) instead of theta ** (-2i / head_dim)."""
    original = port_model.rope_inv_freq

    def inv_freq(layer, device=None):
        if layer.rope_type != "proportional":
            return original(layer, device)
        n = layer.rotated_freqs
        rotated = 1.0 / layer.rope_theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float, device=device) / (2 * n))
        return torch.cat([rotated, torch.zeros(layer.head_dim // 2 - n, device=device)])

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

    def forward(self, inputs_embeds, positions, capture=False, **kwargs):
        out = original(self, inputs_embeds, positions, capture, **kwargs)
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
    prefill, decode = port_engine.Engine.prefill_rows, port_engine.Engine.decode_rows

    def padded_prefill(self, prompts, seq_ids, capture=False):
        results = prefill(self, prompts, seq_ids, capture)
        self.padding = {int(s): r.bucket - r.logits.shape[0] for s, r in zip(seq_ids, results)}
        return results

    def late_decode(self, tokens, positions, seq_ids, capture=False):
        return decode(self, tokens, [p + self.padding[int(s)] for p, s in zip(positions, seq_ids)], seq_ids, capture)

    monkeypatch.setattr(port_engine.Engine, "prefill_rows", padded_prefill)
    monkeypatch.setattr(port_engine.Engine, "decode_rows", late_decode)


def exact_gelu(monkeypatch):
    """The MLP's activation is the exact (erf) GELU instead of gelu_pytorch_tanh: everywhere within
    ~1e-3 of the right value, inside the bf16 envelope at every point."""

    def forward(self, x):
        return self.down_proj(port_model.F.gelu(self.gate_proj(x)) * self.up_proj(x))

    monkeypatch.setattr(port_model.MLP, "forward", forward)


def rope_angles_in_activation_dtype(monkeypatch):
    """positions * inv_freq computed in the activation dtype (bf16 in the port) instead of fp32:
    the angle's rounding grows with the position, inside the envelope below position ~70."""

    def cos_sin(inv_freq, positions, dtype):
        freqs = positions[..., None].to(dtype) * inv_freq.to(dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    monkeypatch.setattr(port_model, "rope_cos_sin", cos_sin)


def rope_angles_in_bf16(monkeypatch):
    """The same angles hard-coded in bf16 (`.bfloat16()`), whatever the activation dtype."""

    def cos_sin(inv_freq, positions, dtype):
        freqs = positions[..., None].bfloat16() * inv_freq.bfloat16()
        emb = torch.cat((freqs, freqs), dim=-1).float()
        return emb.cos().to(dtype), emb.sin().to(dtype)

    monkeypatch.setattr(port_model, "rope_cos_sin", cos_sin)


def window_one_too_wide_in_decode(monkeypatch):
    """Decode steps (one query) keep window + 1 keys; prefill is right. Only decode past the window
    sees it."""
    original = port_model.attention_mask

    def mask(positions, kv_len, window, dtype):
        if window is not None and positions.shape[-1] == 1:
            window = window + 1
        return original(positions, kv_len, window, dtype)

    monkeypatch.setattr(port_model, "attention_mask", mask)


def host_softcap_without_divide(monkeypatch):
    """The host softcap written cap * tanh(x) (the division by cap forgotten): monotone, so greedy
    tokens never change, but every served probability is wrong."""
    monkeypatch.setattr(port_engine, "softcap", lambda logits, cap: logits.float() if cap is None
                        else cap * torch.tanh(logits.float()))


def shared_softcap_formula_wrong(monkeypatch):
    """The softcap formula wrong at its source, harness.base.numerics, where the port and the judge's
    fallbacks both read it (cap * tanh(x)): the reference, which takes its capped distribution and
    its greedy tokens from transformers alone, does not lean on it, so the check still sees it."""
    from harness.base import numerics
    from harness.judge import tokens as judge

    def wrong(logits, cap):
        return logits.float() if cap is None else cap * torch.tanh(logits.float())

    for module in (numerics, port_engine, judge):
        monkeypatch.setattr(module, "softcap", wrong)


def host_probabilities_uncapped(monkeypatch):
    """The host serves softmax of the raw logits (the softcap left out where probabilities are asked)."""
    monkeypatch.setattr(port_engine.Engine, "probabilities",
                        lambda self, logits: torch.softmax(logits.float(), dim=-1))


def full_layers_get_sliding_mask(monkeypatch):
    """The decoder's layer loop hands every layer the first layer's (sliding) mask: a wiring error in
    RankDecoder, not in any one layer."""

    def run_layers(self, x, positions, start, stop, captures=None):
        window = self.spec.layers[0].window
        mask = port_model.attention_mask(positions, self.layers[0].self_attn.cache.key_positions(positions),
                                         window, x.dtype)
        for i in range(start, stop):
            inv_freq = port_model.rope_inv_freq(self.spec.layers[i], positions.device)
            cos, sin = port_model.rope_cos_sin(inv_freq, positions, x.dtype)
            x = self.layers[i](x, cos, sin, positions, mask, captures, f"layers.{i}.")
            if captures is not None:
                captures[f"layers.{i}.output"] = x
        return x

    monkeypatch.setattr(port_model.RankDecoder, "run_layers", run_layers)


def decode_cache_written_one_late(monkeypatch):
    """Decode steps write their key and value one slot past their position (prefill is right): the
    query attends a stale slot and the new key lands where the mask hides it."""
    original = port_kv.KVCache.update

    def update(self, positions, k, v):
        if positions.shape[-1] == 1:
            positions = (positions + 1).clamp_max(self.k.shape[2] - 1)
        return original(self, positions, k, v)

    monkeypatch.setattr(port_kv.KVCache, "update", update)


def decode_rope_one_position_late(monkeypatch):
    """Decode steps rotate q and k for position + 1 (the cache slot and mask are right)."""
    original = port_model.rope_cos_sin

    def cos_sin(inv_freq, positions, dtype):
        return original(inv_freq, positions + 1 if positions.shape[-1] == 1 else positions, dtype)

    monkeypatch.setattr(port_model, "rope_cos_sin", cos_sin)


def decode_token_off_by_one(monkeypatch):
    """The host's decode loop records the previous step's token as this step's output after the
    first step (its logits are right, the sequence it reports is not)."""
    original = port_decode.generate  # the one decode loop (harness/port/decode.py)

    def generate(engine, prompts, new_tokens, step=port_decode.Greedy(), **options):
        out = original(engine, prompts, new_tokens, step, **options)
        for run in out if isinstance(step, port_decode.Greedy) else ():
            if len(run.tokens) > 2:
                run.tokens = run.tokens[:2] + run.tokens[1:-1]
        return out

    monkeypatch.setattr(port_decode, "generate", generate)


def decode_raises_past_window(monkeypatch):
    """A port bug that raises (an index error) in a decode step past the sliding window."""
    original = port_engine.Engine.decode_rows

    def decode_rows(self, tokens, positions, seq_ids, capture=False):
        if max(positions) >= 2 * WINDOW:
            raise IndexError(f"cache slot {max(positions)} out of range")
        return original(self, tokens, positions, seq_ids, capture)

    monkeypatch.setattr(port_engine.Engine, "decode_rows", decode_rows)


# ---- long-context faults: the ring cache and chunked prefill (run on LONG) -----------------------

def _ring_write(cache, positions, k, v, slot_positions):
    """RingCache's write with the slot -> position map given (the faults below change it)."""
    first = positions[0, 0]
    row = slot_positions - first
    take = (row >= 0)[None, None, :, None]
    prior_k, prior_v = cache.k, cache.v
    cache.k = torch.where(take, k.index_select(2, row.clamp(min=0)), prior_k)
    cache.v = torch.where(take, v.index_select(2, row.clamp(min=0)), prior_v)
    return torch.cat([prior_k, k], dim=2), torch.cat([prior_v, v], dim=2)


def ring_index_off_by_one(monkeypatch):
    """The ring writes position p into slot (p + 1) % window while the mask (and the cache read)
    take slot s to hold the position p % window == s."""

    def update(self, positions, k, v):
        written_to = positions[0, 0] + (positions[0] >= 0).sum()
        slots = port_kv.ring_slot_positions(written_to, self.window).roll(1)  # slot s takes p = s - 1
        return _ring_write(self, positions, k, v, slots)

    monkeypatch.setattr(port_kv.RingCache, "update", update)


def stale_ring_slot_visible(monkeypatch):
    """Ring slots masked only by whether they were ever written, not by the position they hold: once
    the ring wraps, the slot a query's window has left (position p - window) stays visible."""

    def key_positions(self, positions):
        first = positions[0, 0]
        slots = port_kv.ring_slot_positions(first, self.window)
        return torch.cat([torch.where(slots >= 0, first - 1, slots), positions[0]])

    monkeypatch.setattr(port_kv.RingCache, "key_positions", key_positions)


def chunk_positions_offset(monkeypatch):
    """Every prefill chunk after the first is fed positions one too far (rope, mask and cache slots
    of start + 1 ...): the first chunk and decode are right."""
    original = port_engine.chunk_positions

    def positions(start, length, bucket):
        return original(start + 1 if start > 0 else start, length, bucket)

    monkeypatch.setattr(port_engine, "chunk_positions", positions)


def chunk_ignores_cached_prefix(monkeypatch):
    """A prefill chunk after the first attends only to its own keys: the mask hides every key before
    the chunk's first position (decode steps, one query, still read the cache)."""
    original = port_model.attention_mask

    def mask(positions, keys, window, dtype):
        if positions.shape[-1] > 1:
            keys = torch.arange(keys) if isinstance(keys, int) else keys
            keys = torch.where(keys < positions[0, 0], -1, keys)
        return original(positions, keys, window, dtype)

    monkeypatch.setattr(port_model, "attention_mask", mask)


def decode_kv_bucket_one_too_small(monkeypatch):
    """Decode steps read the KV bucket below the one that holds their positions (where there is
    one): the newest keys, the step's own included, drop out of attention."""
    from harness.port import graphs as port_graphs

    original = port_graphs.kv_read_length

    def read_length(positions, kv_lengths):
        size = original(positions, kv_lengths)
        smaller = [b for b in kv_lengths if b < size]
        return max(smaller) if positions.shape[-1] == 1 and smaller else size

    for module in (port_graphs, port_cpu):
        monkeypatch.setattr(module, "kv_read_length", read_length)


def chunk_reads_overwritten_keys(monkeypatch):
    """The ring is written before the chunk attends: the chunk's early queries read, in the slots
    they still need (positions p - window + 1 ...), the keys of its own later rows."""
    original = port_kv.RingCache.update

    def update(self, positions, k, v):
        original(self, positions, k, v)
        return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)

    monkeypatch.setattr(port_kv.RingCache, "update", update)


# ---- the catalog --------------------------------------------------------------------------------

FIRST_FULL = 5  # the tiny fixture's first full-attention layer (full layers 5 and 11)
WINDOW = 16  # the tiny fixture's sliding window; the default prompts of 24, 40 and 64 tokens cross it
LOCATION = ("first point", "first layer", "component")


def _attn(layer: int) -> str:
    return f"layers.{layer}.attn_residual"


def _kv(layer: int, side: str) -> str:
    """The KV cache point of a layer after prefill: keys after k_norm and rope, values after v_norm."""
    return f"kv.{layer}.{side}"


CATALOG: list[Fault] = [
    Fault("kv-repeat-not-interleave", "port: one KV head",
          "query heads mapped to KV heads with repeat (j % nkv) instead of repeat_interleave "
          "(j // groups); identical at one KV head per rank, so only sliding layers break",
          repeat_not_interleave, Expectation(_attn(0), 0, "attention", fp32_point=_attn(0))),
    Fault("single-kv-head-split", "port: one KV head",
          "the one KV head of full layers split over ranks by head_dim halves instead of "
          "replicated: k_norm and v_norm each see half a head",
          split_single_kv_head, Expectation(_kv(FIRST_FULL, "k"), FIRST_FULL, "attention",
                                            fp32_point=_kv(FIRST_FULL, "k"))),
    Fault("kv-heads-wrong-rank", "port: one KV head",
          "sliding layers' sharded KV heads loaded on the wrong rank (rank r gets rank 1-r's)",
          kv_heads_of_other_rank, Expectation(_attn(0), 0, "attention", fp32_point=_attn(0))),
    Fault("rmsnorm-one-plus-weight", "trap 1", "RMSNorm multiplies by 1 + weight",
          one_plus_weight_rms_norm, Expectation(_kv(0, "k"), 0, "attention", fp32_point=_kv(0, "k"))),
    Fault("rmsnorm-no-fp32-upcast", "trap 1", "RMSNorm computed in bf16, not upcast to fp32: a no-op in the "
          "fp32 stage and every point within ~1.3x the envelope, but R's median moves to 1.10-1.12 on every "
          "layer alone: the distributional gate fails it (tests/faults/precision.py names layer 0)",
          rms_norm_without_fp32, Expectation(None, None, None, stages=("distribution",), fp32_point=None),
          local=True),
    Fault("attention-inverse-sqrt-scale", "trap 2", "attention scores scaled by 1/sqrt(head_dim), not 1.0",
          inverse_sqrt_scale, Expectation(_attn(0), 0, "attention", fp32_point=_attn(0))),
    Fault("missing-v-norm", "trap 3", "the weightless v_norm left out",
          missing_v_norm, Expectation(_kv(0, "v"), 0, "attention", fp32_point=_kv(0, "v"))),
    Fault("value-after-k-norm", "trap 3",
          "full layers (k_eq_v) take the value after k_norm instead of the raw k_proj output",
          value_after_k_norm, Expectation(_kv(FIRST_FULL, "v"), FIRST_FULL, "attention",
                                          fp32_point=_kv(FIRST_FULL, "v"))),
    Fault("full-rotary-on-full-layers", "trap 4",
          "full layers rotate every frequency instead of the proportional 25 %",
          full_rotary_on_full_layers, Expectation(_kv(FIRST_FULL, "k"), FIRST_FULL, "attention",
                                                  fp32_point=_kv(FIRST_FULL, "k"))),
    Fault("proportional-over-rotated-width", "trap 4",
          "proportional inv_freq exponent divided by the rotated width, not the full head_dim",
          proportional_over_rotated_width, Expectation(_kv(FIRST_FULL, "k"), FIRST_FULL, "attention",
                                                      fp32_point=_kv(FIRST_FULL, "k"))),
    Fault("rope-interleaved-pairs", "trap 4", "rope rotates lanes 2i, 2i+1 instead of i, i + D/2",
          rope_interleaved_pairs, Expectation(_kv(0, "k"), 0, "attention", fp32_point=_kv(0, "k"))),
    Fault("window-one-too-wide", "trap 8", "sliding mask keeps window + 1 keys (i - W <= j)",
          window_one_too_wide, Expectation(_attn(0), 0, "attention", min_position=WINDOW, fp32_point=_attn(0))),
    Fault("window-one-too-narrow", "trap 8", "sliding mask keeps window - 1 keys",
          window_one_too_narrow, Expectation(_attn(0), 0, "attention", min_position=WINDOW - 1,
                                             fp32_point=_attn(0))),
    Fault("sliding-layers-causal", "trap 8", "sliding layers get the plain causal mask (no window)",
          sliding_layers_plain_causal, Expectation(_attn(0), 0, "attention", min_position=WINDOW,
                                                   fp32_point=_attn(0))),
    Fault("layer-scalar-missing", "trap 5",
          "layer_scalar not loaded (left at 1.0): the residuals are right, the layer output is not",
          layer_scalar_not_loaded, Expectation("layers.0.output", 0, "mlp", fp32_point="layers.0.output")),
    Fault("softcap-twice", "port: host softcap",
          "the device graph returns capped logits and the host caps them again; every hidden-state "
          "capture point is upstream of the logits, so only the logits point can show it",
          softcap_on_device, Expectation("logits", fp32_point="logits")),
    Fault("embed-scale-not-cast", "trap 7",
          "sqrt(hidden) applied in fp32 instead of cast to bf16 first; a no-op on the default "
          "fixture (sqrt(64) = 8 is exact in bf16), so run on a hidden-72 variant. An envelope "
          "anchored on fp32 cannot see it (the fault moves bf16 toward fp32); the embeddings' "
          "bit-exactness with the bf16 reference does",
          embed_scale_not_cast, Expectation("embeddings", stages=("bf16",), fp32_point=None),
          checkpoint=TINY_INEXACT_SCALE),
    Fault("decode-from-bucket-length", "port: buckets",
          "decode continues at the bucket length: padded keys leak into every decode step",
          decode_from_bucket_length, Expectation("decode.kv.0.k", 0, "attention", tokens=True,
                                                 fp32_point="decode.kv.0.k")),
    # -- faults inside bf16 noise, decode-only, host-side: what the fp32 stage, the decode and KV
    # capture points and the host probability check exist for (issue 13)
    Fault("exact-gelu", "trap 6", "the MLP uses the exact (erf) GELU instead of gelu_pytorch_tanh: within "
          "~1e-3 everywhere, inside the bf16 envelope at every point",
          exact_gelu, Expectation(None, 0, "mlp", stages=("fp32",), fp32_point="layers.0.mlp_residual")),
    Fault("rope-angles-activation-dtype", "trap 4", "rope angles (positions x inv_freq) computed in the "
          "activation dtype: bf16 in the port, so exact in the fp32 stage; the rounding grows with position",
          rope_angles_in_activation_dtype, Expectation(_kv(0, "k"), 0, "attention", min_position=200,
                                                      stages=("bf16",), fp32_point=None)),
    Fault("rope-angles-bf16", "trap 4", "rope angles hard-coded in bf16, whatever the activation dtype",
          rope_angles_in_bf16, Expectation(_kv(0, "k"), 0, "attention", min_position=200, fp32_point=_kv(0, "k"))),
    Fault("window-one-too-wide-in-decode", "trap 8; port: KV cache", "decode steps keep window + 1 keys; "
          "prefill is right",
          window_one_too_wide_in_decode, Expectation("decode.layers.0.attn_residual", 0, "attention",
                                                     fp32_point="decode.layers.0.attn_residual")),
    Fault("host-softcap-without-divide", "port: host softcap", "the host softcap is cap * tanh(x): monotone, so "
          "greedy tokens never change, but every served probability is wrong",
          host_softcap_without_divide, Expectation("probabilities", fp32_point="probabilities")),
    Fault("shared-softcap-formula-wrong", "port: host softcap; layers",
          "the softcap formula wrong in harness.base.numerics, "
          "shared by the port and the judge's fallbacks: the reference computes from transformers alone",
          shared_softcap_formula_wrong, Expectation("probabilities", fp32_point="probabilities")),
    Fault("host-probabilities-uncapped", "port: host softcap", "the host serves softmax of the raw logits",
          host_probabilities_uncapped, Expectation("probabilities", fp32_point="probabilities")),
    Fault("full-layers-sliding-mask", "trap 8", "the decoder's layer loop gives every layer the first "
          "layer's sliding mask (a wiring error in RankDecoder, not in a layer)",
          full_layers_get_sliding_mask, Expectation(_attn(FIRST_FULL), FIRST_FULL, "attention",
                                                    min_position=WINDOW, fp32_point=_attn(FIRST_FULL))),
    Fault("decode-cache-one-slot-late", "port: KV cache", "decode steps write their key and value one "
          "slot past their position",
          decode_cache_written_one_late, Expectation("decode.kv.0.k", 0, "attention", fp32_point="decode.kv.0.k")),
    Fault("decode-rope-one-position-late", "trap 4; port: KV cache", "decode steps rotate q and k for "
          "position + 1",
          decode_rope_one_position_late, Expectation("decode.kv.0.k", 0, "attention", fp32_point="decode.kv.0.k")),
    Fault("decode-token-off-by-one", "port: recipe", "the host's decode loop reports the previous step's "
          "token (logits right, sequence wrong)",
          decode_token_off_by_one, Expectation(None, fp32_point="sequence")),
    Fault("decode-raises", "port: recipe", "a port bug that raises in decode past the window",
          decode_raises_past_window, Expectation(None, fp32_point="exception inside the port")),
    # -- long context (issue 21): the ring cache and chunked prefill, on LONG; the first chunk is 12
    # positions, so none of these can show before position 12
    Fault("ring-index-off-by-one", "port: KV cache", "the ring writes position p into slot (p + 1) % window",
          # every write is misplaced, the first chunk's too: the ring read back after prefill (the
          # last window positions of each prompt, from position 8 on) shows it first
          ring_index_off_by_one, Expectation(_kv(0, "k"), 0, "attention", min_position=LONG_WINDOW,
                                             fp32_point=_kv(0, "k")), checkpoint=LONG),
    Fault("stale-ring-slot-visible", "trap 8 (sliding window) / port: KV cache", "ring slots masked by being written, not by "
          "their position: after wrap-around a slot older than the window stays visible",
          stale_ring_slot_visible, Expectation(_attn(0), 0, "attention", min_position=LONG_BUCKETS[-1],
                                               fp32_point=_attn(0)), checkpoint=LONG),
    Fault("chunk-positions-offset", "port: buckets", "prefill chunks after the first are fed positions "
          "one too far", chunk_positions_offset, Expectation(_kv(0, "k"), 0, "attention",
                                                            min_position=LONG_BUCKETS[-1], fp32_point=_kv(0, "k")),
          checkpoint=LONG),
    Fault("chunk-ignores-cached-prefix", "port: buckets", "a prefill chunk after the first attends only to "
          "its own keys", chunk_ignores_cached_prefix, Expectation(_attn(0), 0, "attention",
                                                                   min_position=LONG_BUCKETS[-1],
                                                                   fp32_point=_attn(0)), checkpoint=LONG),
    Fault("chunk-reads-overwritten-keys", "port: KV cache", "the ring written before the chunk attends: "
          "early queries read keys the chunk's later rows just overwrote",
          chunk_reads_overwritten_keys, Expectation(_attn(0), 0, "attention", min_position=LONG_BUCKETS[-1],
                                                    fp32_point=_attn(0)), checkpoint=LONG),
    Fault("decode-kv-bucket-one-too-small", "port: buckets", "decode steps read the KV bucket below the one "
          "holding their positions: the newest keys drop out",
          decode_kv_bucket_one_too_small, Expectation("decode.layers.0.attn_residual", 0, "attention",
                                                      fp32_point="decode.layers.0.attn_residual")),
]

BY_NAME = {fault.name: fault for fault in CATALOG}


# ---- the Gemma-4 family's parts (issue 22): faults on tiny transformers-built variants ------------

TINY_E2B, TINY_E4B, TINY_MOE = "tiny-e2b", "tiny-e4b", "tiny-26b-a4b"
TINY_UNIFIED_KV = "tiny-unified-kv"  # the tiny 12B with KV sharing (harness/inputs/tiny.py TINY_UNIFIED_KV)
# The default prompts of 7, 24, 40 and 64 tokens (past the sliding window of 16) with decode steps:
# enough rows for the probability envelope's quantile, and still cheap on the tiny variants.
def _family_prompts() -> list[list[int]]:
    from harness.inputs.prompts import load_prompts

    return [p for p in load_prompts() if len(p) <= 64]


FAMILY_PROMPTS = _family_prompts()
FAMILY_NEW_TOKENS = 8
FAMILY_BUCKETS, FAMILY_KV_LEN = (64,), 128


def ple_combine_factor_wrong(monkeypatch):
    """(projection + table row) summed without the 1/sqrt(2) of transformers' per_layer_input_scale."""
    monkeypatch.setattr(port_blocks, "PLE_COMBINE", 1.0)


def ple_table_unscaled(monkeypatch):
    """The host's per-layer table rows not multiplied by sqrt(per_layer_input)."""
    monkeypatch.setattr(port_engine, "per_layer_rows", lambda table, ids, width: table[ids])


def ple_wrong_layer_slice(monkeypatch):
    """Layer i gets the packed per-layer input of layer i + 1 (the slice one layer off)."""
    layers = lambda per_layer: per_layer.shape[2]  # noqa: E731
    monkeypatch.setattr(port_blocks.FamilyRankDecoder, "layer_input",
                        staticmethod(lambda per_layer, i: per_layer[:, :, (i + 1) % layers(per_layer)]))


def kv_shared_source_off_by_one(monkeypatch):
    """A KV-shared layer reads the cache of the layer before its source, where that layer has the
    same attention type (tiny-e4b's sliding shared layers 8-10 read 6, not 7); elsewhere the shapes
    differ and the port would raise, which the check reports too but cannot place."""
    def source_of(self, layer):
        before = layer.kv_source - 1
        return before if self.spec.layers[before].type == layer.type else layer.kv_source

    monkeypatch.setattr(port_blocks.FamilyRankDecoder, "source_of", source_of)


def shared_layer_writes_cache(monkeypatch):
    """A KV-shared layer writes into the cache it reads (its rotated queries of the source's KV head
    count, at its positions), as if it kept the store path of an unshared layer."""
    original = port_blocks.SharedKVAttention.forward

    def forward(self, x, cos, sin, positions, mask):
        b, s, _ = x.shape
        cache = self.source_cache
        heads = cache.k.shape[1]
        q = port_model.apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.q_heads, self.head_dim)), cos, sin)
        own = q[:, :, :heads].transpose(1, 2)
        cache.update(positions, own, own)
        return original(self, x, cos, sin, positions, mask)

    monkeypatch.setattr(port_blocks.SharedKVAttention, "forward", forward)


def _router_forward(bf16_softmax=False, renormalise=True, expert_scale=True, skip_best=False):
    def forward(self, x):
        logits = self.proj(port_model.rms_norm(x, None, self.eps) * self.scale * self.root)
        probs = (torch.softmax(logits.to(torch.bfloat16), dim=-1) if bf16_softmax
                 else torch.softmax(logits, dim=-1, dtype=torch.float32))
        weights, chosen = torch.topk(probs.float(), k=self.top_k + int(skip_best), dim=-1)
        if skip_best:  # experts ranked 2..k+1: a routing error, not a weights error
            weights, chosen = weights[:, 1:], chosen[:, 1:]
        if renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights * self.per_expert_scale[chosen] if expert_scale else weights, chosen
    return forward


def router_softmax_bf16(monkeypatch):
    monkeypatch.setattr(port_blocks.Router, "forward", _router_forward(bf16_softmax=True))


def topk_not_renormalised(monkeypatch):
    monkeypatch.setattr(port_blocks.Router, "forward", _router_forward(renormalise=False))


def per_expert_scale_missing(monkeypatch):
    monkeypatch.setattr(port_blocks.Router, "forward", _router_forward(expert_scale=False))


def router_skips_best_expert(monkeypatch):
    monkeypatch.setattr(port_blocks.Router, "forward", _router_forward(skip_best=True))


def moe_sum_without_norms(monkeypatch):
    """The dense MLP and the experts summed raw, without post_feedforward_layernorm_1/_2 (and the
    experts' input without pre_feedforward_layernorm_2)."""
    def feed_forward(self, h, captures, prefix):
        flat = h.reshape(-1, h.shape[-1])
        logits, weights, chosen = self.router(flat)
        if captures is not None:
            captures[prefix + "router_logits"] = logits.view(*h.shape[:-1], -1)
            dense = torch.zeros_like(logits, dtype=torch.float32).scatter(-1, chosen, weights)
            captures[prefix + "expert_weights"] = dense.view(*h.shape[:-1], -1)
        return self.mlp(self.pre_feedforward_layernorm(h)) + self.experts(flat, weights, chosen).view(h.shape)

    monkeypatch.setattr(port_blocks.FamilyDecoderLayer, "feed_forward", feed_forward)


# Each family fault is caught at its own part's capture point (harness/base/points.py layer_parts: the
# judged points of a layer follow the spec): a PLE fault at the gated per-layer input, a router
# fault at the chosen experts' weights. On the MoE variant the bf16 stage teacher-forces routing
# (harness/judge/routing.py): the references follow the port's router choices, and each choice that
# differs from the fp32 top-k must be a near tie. A router that picks the wrong experts therefore
# fails there as a routing divergence, while its weights compare along the same path; a router
# softmax in bf16 moves the weights by bf16's own rounding, which only the fp32 stage can see (its
# bf16 stage fails on the token flips the fp32 port shows too).
_PLE, _ROUTER = "layers.0.per_layer_input", "layers.0.expert_weights"


FAMILY_CATALOG: list[Fault] = [
    Fault("ple-combine-factor", "family: PLE", "per-layer inputs combined without the 1/sqrt(2) factor",
          ple_combine_factor_wrong, Expectation(_PLE, 0, "per-layer input", fp32_point=_PLE), TINY_E2B),
    Fault("ple-table-unscaled", "family: PLE", "the per-layer table's rows not scaled by sqrt(per_layer_input)",
          ple_table_unscaled, Expectation(_PLE, 0, "per-layer input", fp32_point=_PLE), TINY_E2B),
    Fault("ple-wrong-layer-slice", "family: PLE", "layer i reads layer i+1's slice of the per-layer inputs",
          ple_wrong_layer_slice, Expectation(_PLE, 0, "per-layer input", fp32_point=_PLE), TINY_E2B),
    Fault("kv-shared-source-off-by-one", "family: KV sharing", "the shared layers read layer source - 1's cache",
          kv_shared_source_off_by_one, Expectation(_attn(8), 8, "attention", fp32_point=_attn(8)), TINY_E4B),
    Fault("shared-layer-writes-cache", "family: KV sharing",
          "a KV-shared layer writes into the cache it reads (its source's): the source's cache point breaks",
          shared_layer_writes_cache, Expectation(_kv(5, "k"), 5, "attention", fp32_point=_kv(5, "k")), TINY_E4B),
    # The same two faults in gemma4_unified's KV sharing (issue 45): layers 8-10 read layer 7's cache,
    # layer 11 layer 5's (a full layer), as on the E4B.
    Fault("kv-shared-source-off-by-one-unified", "unified: KV sharing", "the shared layers read layer source - 1's "
          "cache", kv_shared_source_off_by_one, Expectation(_attn(8), 8, "attention", fp32_point=_attn(8)),
          TINY_UNIFIED_KV),
    Fault("shared-layer-writes-cache-unified", "unified: KV sharing",
          "a KV-shared layer writes into the cache it reads (its source's): the source's cache point breaks",
          shared_layer_writes_cache, Expectation(_kv(5, "k"), 5, "attention", fp32_point=_kv(5, "k")), TINY_UNIFIED_KV),
    Fault("router-softmax-bf16", "family: MoE", "the router's softmax in bf16, not fp32 (its weights' error is "
          "bf16's own size: the fp32 stage's weights point shows it; since issue 45 the bf16 stage's routing "
          "verdict too: on near-tied experts it chooses what transformers' bf16 router never does on the same "
          "input, decided on the port's own path)",
          router_softmax_bf16, Expectation(_ROUTER, 0, "moe router", fp32_point=_ROUTER), TINY_MOE),
    Fault("topk-not-renormalised", "family: MoE", "the top-k router weights not renormalised to sum 1",
          topk_not_renormalised, Expectation(_ROUTER, 0, "moe router", fp32_point=_ROUTER), TINY_MOE),
    Fault("per-expert-scale-missing", "family: MoE", "the router's per-expert scale not applied",
          per_expert_scale_missing, Expectation(_ROUTER, 0, "moe router", fp32_point=_ROUTER), TINY_MOE),
    Fault("router-skips-best-expert", "family: MoE", "top-k takes the experts ranked 2..k+1 (a routing "
          "error: the bf16 stage's routing verdict names it, not a near tie)",
          router_skips_best_expert, Expectation(_ROUTER, 0, "moe router", fp32_point=_ROUTER), TINY_MOE),
    Fault("moe-sum-without-norms", "family: MoE", "dense MLP and experts summed without their norms",
          moe_sum_without_norms, Expectation("layers.0.mlp_residual", 0, "mlp",
                                             fp32_point="layers.0.mlp_residual"), TINY_MOE),
]


def run_family_check(fault: Fault | None, monkeypatch, checkpoint, references, tp: int = 2):
    """Inject `fault`, build the port (bf16, CPU) for a family checkpoint and run the check (both
    stages, no local verdicts: their layers mostly cannot run alone)."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port

    if fault is not None:
        fault.inject(monkeypatch)
    engine = build_engine(checkpoint, RunSettings(tp=tp, dtype="bfloat16", buckets=FAMILY_BUCKETS, kv_len=FAMILY_KV_LEN))
    return check_port(checkpoint, engine, references["float32"], references["bfloat16"], local=False)


# ---- running a fault and reading what caught it -------------------------------------------------

def engine_options(key: str) -> dict:
    """Buckets, KV length and sliding cache the check builds the port with for a fixture key."""
    return ENGINE_OPTIONS.get(key, {"buckets": CHECK_BUCKETS, "kv_len": CHECK_KV_LEN})


def run_faulty_check(fault: Fault | None, monkeypatch, checkpoint, references, local: bool | None = None,
                     key: str = TINY):
    """Inject `fault` (None: the clean port), build the port (TP=2, bf16, CPU; buckets and cache of
    the fault's fixture, else of `key`) and run the parity check against the references (fp32 and
    bf16) computed once for the checkpoint."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port

    if fault is not None:
        fault.inject(monkeypatch)
        key = fault.checkpoint
    engine = build_engine(checkpoint, RunSettings(**engine_options(key)))
    if local is None:
        local = fault is None or fault.local
    return check_port(checkpoint, engine, references["float32"], references["bfloat16"], local=local)


def failing_points(result) -> list:
    """Every capture point of the bf16 (envelope) stage that broke the policy, in run order
    (embeddings that are within the envelope but not bit-exact with the same-dtype reference count
    as failing)."""
    failing = [p for p in result.all_points() if result.point_failed(p)] + [p for p in result.probabilities if not p.passed]
    if not result.embeddings_exact and result.embeddings not in failing:
        failing.insert(0, result.embeddings)
    return failing


def first_failure(stage) -> dict | None:
    """The first failure of one stage's result (a point, a token, an exception), or None."""
    if stage is None:
        return None
    failures = stage.failures()
    return failures[0] if failures else None


def _worst_position(result, point, prompt_lengths: list[int]) -> int:
    """Position in its prompt of a prefill point's worst row: from the check's own row label (a ring
    layer's KV rows are only the last window positions), else counted over the prompts' rows."""
    label = result.row_label(point.name, point.worst_position)
    if "position " in label:
        return int(label.rsplit("position ", 1)[1].split()[0])
    return prompt_position(point.worst_position, prompt_lengths)


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
    first_point: str | None  # the bf16 stage's first failing capture point
    first_point_factor: float | None  # the ENVELOPE_FACTOR that would have passed it
    first_layer: int | None
    component: str | None
    worst_position: int | None  # in its prompt, for the first failing point
    divergences: int
    near_ties: int
    seq_match: bool
    kl_max: float
    stages: tuple[str, ...] = ()
    fp32_point: str | None = None  # the fp32 stage's first failure (point, token or exception)
    fp32_where: str | None = None
    bf16_failure: str | None = None  # the bf16 stage's first failure, whatever its kind
    bf16_where: str | None = None

    @classmethod
    def of(cls, result) -> "Caught":
        bf16 = result.bf16
        failing = failing_points(bf16) if bf16.port_error is None else []
        first = failing[0] if failing else None
        lengths = [len(p.prompt) for p in bf16.prompts]
        layer = result.first_divergent_layer
        f32, f16 = first_failure(result.fp32), first_failure(bf16)
        return cls(
            passed=result.passed, first_point=first.name if first else None,
            first_point_factor=getattr(first, "required_factor", getattr(first, "ratio", None)) if first else None,
            first_layer=layer, component=result.first_divergent_component,
            worst_position=(_worst_position(bf16, first, lengths)
                            if first is not None and not first.name.startswith("decode") else None),
            divergences=bf16.divergences, near_ties=bf16.near_ties, seq_match=result.seq_match,
            kl_max=max((max(p.prefill.kl_max, p.decode.kl_max) for p in bf16.prompts), default=0.0),
            stages=tuple(result.failed_stages), fp32_point=f32["point"] if f32 else None,
            fp32_where=f32.get("where") if f32 else None, bf16_failure=f16["point"] if f16 else None,
            bf16_where=f16.get("where") if f16 else None,
        )

    def caught_by(self) -> str:
        if self.passed:
            return "**not caught** (check passes)"
        parts = []
        if self.fp32_point is not None:
            parts.append(f"fp32 stage: `{self.fp32_point}` at {self.fp32_where}")
        if self.bf16_failure is not None:
            bf16 = f"bf16 stage: `{self.bf16_failure}` at {self.bf16_where}"
            if self.first_point == self.bf16_failure and self.first_point_factor is not None:
                bf16 += f", {self.first_point_factor:.0f}x envelope"
            parts.append(bf16)
        if self.first_layer is not None:
            parts.append(f"layer {self.first_layer} ({self.component})")
        if self.divergences:
            parts.append(f"{self.divergences} real token divergence{'s' if self.divergences > 1 else ''}")
        return "; ".join(parts)


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
    # the two stages exactly; a further stage (the distribution of R, ...) where the expectation names it
    core = {"fp32", "bf16"}
    if set(caught.stages) & core != set(expect.stages) & core or not set(expect.stages) <= set(caught.stages):
        missed.append("stages")
    if expect.fp32_point != "-" and caught.fp32_point != expect.fp32_point:
        missed.append("fp32 point")
    return missed


TABLE_HEADER = (
    "| # | fault | design | expected | caught by (`gemma-parity check`) | failing stages | "
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
    stages = ", ".join(caught.stages) or "none"
    tokens = f"{'yes' if caught.seq_match else 'no'}, {caught.divergences} / {caught.near_ties}"
    return (f"| {k} | {fault.name} | {fault.design} | {_expected(fault.expect)} | {caught.caught_by()} "
            f"| {stages} | {tokens} | {caught.kl_max:.2f} | {verdict} |")


def inexact_scale_checkpoint(out_dir):
    """The tiny config with a hidden size whose sqrt is inexact in bf16, built into `out_dir`."""
    import json

    from harness.inputs.tiny import TINY_CONFIG, build_tiny_checkpoint

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

    from harness.inputs.checkpoint import Checkpoint

    from harness.inputs.prompts import DEFAULT_NEW_TOKENS, load_prompts
    from harness.inputs.tiny import tiny_checkpoint
    from harness.reference.run import run_reference

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
