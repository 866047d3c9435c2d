"""The per-rank Gemma-4 text decoder the device runs: one rank's shapes, static, eager attention.

Written for one rank (sharding.py decides which heads it holds). Projections are built by a
`RankLinears` factory: on CPU plain nn.Linear with explicit collectives between ranks; the Neuron
backend swaps in NxD's parallel layers. Outputs are raw logits: no softcap on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.base.settings import DEFAULT_KV_LEN
from harness.inputs.spec import LayerSpec, ModelSpec
from harness.port.kv_cache import KVCache, make_cache
from harness.port.sharding import LayerPlan, plan_model


class Collectives:
    """Collectives between the ranks of one TP group. A single rank needs none."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


class RowParallel(nn.Linear):
    """Input split across ranks: partial products summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, collectives: Collectives):
        super().__init__(in_features, out_features, bias=False)
        self.collectives = collectives

    def forward(self, x):
        return self.collectives.all_reduce(F.linear(x, self.weight))


class VocabParallel(nn.Linear):
    """lm_head rows split by vocabulary: each rank's logits slice is gathered on the last dim."""

    def __init__(self, in_features: int, out_features: int, collectives: Collectives):
        super().__init__(in_features, out_features, bias=False)
        self.collectives = collectives

    def forward(self, x):
        return self.collectives.all_gather(F.linear(x, self.weight), dim=-1)


class RankLinears:
    """Builds projections with one rank's shapes (sizes passed are per rank)."""

    def __init__(self, collectives: Collectives | None = None):
        self.collectives = collectives or Collectives()

    def column(self, in_features: int, out_per_rank: int) -> nn.Module:
        return nn.Linear(in_features, out_per_rank, bias=False)

    def replicated(self, in_features: int, out_features: int) -> nn.Module:
        """The same whole weight on every rank (a replicated KV head): no collective, never split."""
        return nn.Linear(in_features, out_features, bias=False)

    def row(self, in_per_rank: int, out_features: int) -> nn.Module:
        return RowParallel(in_per_rank, out_features, self.collectives)

    def vocab(self, in_features: int, vocab_per_rank: int) -> nn.Module:
        return VocabParallel(in_features, vocab_per_rank, self.collectives)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-0.5 * weight, in fp32, cast back. The weight is used as stored."""
    xf = x.float()
    normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (normed if weight is None else normed * weight.float()).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_weight: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(layer: LayerSpec, device=None) -> torch.Tensor:
    """head_dim/2 inverse frequencies; proportional rope rotates only the first few.

    The exponent's denominator is the full head_dim even for proportional rope
    (docs/design.md#the-model-facts-and-traps, trap 4). Computed from constants on `device` each
    forward (as NxD-Inference's rotary embedding does), so a traced graph holds them as computed
    constants, not as buffers a compiler must be fed.
    """
    d, n_rot = layer.head_dim, layer.rotated_freqs
    rotated = 1.0 / (layer.rope_theta ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.float, device=device) / d))
    return torch.cat([rotated, torch.zeros(d // 2 - n_rot, device=device)])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)  # cast to the activation dtype before use


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, d]; cos/sin: [b, s, d]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def attention_mask(positions: torch.Tensor, keys, window: int | None, dtype) -> torch.Tensor:
    """Additive mask [b, 1, s, kv] over the keys attention reads: causal, and on sliding layers
    query i sees keys j with i - window < j <= i (window keys including itself).

    `keys` is a linear cache's length (key j sits in slot j) or the absolute position of each key
    read ([kv], or [b, kv] per row: a ring's slots then the chunk's own keys); a negative position is
    an empty slot or a padded row, never seen. A padded query (position -1) sees nothing."""
    keys = torch.arange(keys, device=positions.device) if isinstance(keys, int) else keys
    keys = keys[:, None, None, :] if keys.dim() == 2 else keys  # per row: [b, 1, 1, kv]
    q = positions[:, None, :, None]
    allowed = (keys <= q) & (keys >= 0)
    if window is not None:
        allowed = allowed & (keys > q - window)
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)  # same device when traced
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


def attention_scale(head_dim: int) -> float:
    """Gemma-4 uses scaling 1.0: q_norm/k_norm take the place of 1/sqrt(head_dim)."""
    return 1.0


def eager_attention(q: torch.Tensor, kv: tuple, mask: torch.Tensor, groups: int) -> torch.Tensor:
    """q [b, q_heads, s, d] over the keys and values read, kv = ([b, kv_heads, n, d] each), each KV
    head shared by `groups` query heads -> [b, s, q_heads * d]. Eager: matmul, fp32 softmax, matmul.
    No fused kernel: at window 1024 the flash kernel's working set overflows SBUF on inf2
    (docs/design.md#the-port)."""
    b, heads, s, d = q.shape
    k_all, v_all = (t.repeat_interleave(groups, dim=1) for t in kv)
    scores = torch.matmul(q, k_all.transpose(2, 3)) * attention_scale(d) + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v_all).transpose(1, 2).reshape(b, s, heads * d)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, plan: LayerPlan, linears: RankLinears,
                 max_len: int, dtype):
        super().__init__()
        d, h = layer.head_dim, spec.hidden_size
        self.head_dim, self.window, self.groups = d, layer.window, plan.groups
        self.q_heads, self.kv_heads = plan.q_heads_per_rank, plan.kv_heads_per_rank
        self.q_proj = linears.column(h, self.q_heads * d)
        # Sharded KV heads are column-parallel; a replicated KV head (the 12B's full layers) is a
        # whole copy on each rank, which a parallel layer would split (docs/design.md#the-port).
        kv_linear = linears.replicated if plan.kv_layout == "replicate" else linears.column
        self.k_proj = kv_linear(h, self.kv_heads * d)
        # Full layers of the 12B have no v_proj: the value is the raw k_proj output.
        self.v_proj = None if layer.k_eq_v else kv_linear(h, self.kv_heads * d)
        self.o_proj = linears.row(self.q_heads * d, h)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.v_norm = RMSNorm(d, spec.rms_norm_eps, with_weight=False)
        self.cache = KVCache(self.kv_heads, max_len, d, dtype)

    def forward(self, x, cos, sin, positions, mask):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.q_heads, self.head_dim))
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k_raw = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        v = k_raw if self.v_proj is None else self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(k_raw), cos, sin).transpose(1, 2)
        v = self.v_norm(v).transpose(1, 2)
        k_all, v_all = self.cache.update(positions, k, v)
        return self.o_proj(eager_attention(q, (k_all, v_all), mask, self.groups))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: int, linears: RankLinears, width: int | None = None):
        super().__init__()
        inter = (width or spec.intermediate_size) // tp  # E2B's shared layers are double-wide
        self.gate_proj = linears.column(spec.hidden_size, inter)
        self.up_proj = linears.column(spec.hidden_size, inter)
        self.down_proj = linears.row(inter, spec.hidden_size)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec, layer: LayerSpec, plan: LayerPlan, linears, max_len, dtype):
        super().__init__()
        eps, h = spec.rms_norm_eps, spec.hidden_size
        self.is_sliding = layer.is_sliding
        self.self_attn = self.make_attention(spec, layer, plan, linears, max_len=max_len, dtype=dtype)
        self.mlp = MLP(spec, plan.tp, linears, spec.mlp_size(layer))
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        # A parameter (a weight every graph reads), never a buffer a trace could fold into a constant.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def make_attention(self, spec, layer: LayerSpec, plan: LayerPlan, linears, max_len, dtype) -> nn.Module:
        """The layer's attention (model_blocks' family layer overrides it for KV-shared layers)."""
        return Attention(spec, layer, plan, linears, max_len, dtype)

    def forward(self, x, cos, sin, positions, mask, captures=None, prefix=""):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, positions, mask))
        out = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if captures is not None:
            captures[prefix + "attn_residual"] = h
            captures[prefix + "mlp_residual"] = out
        return out * self.layer_scalar.to(out.dtype)


class RankDecoder(nn.Module):
    """One rank's decoder: inputs_embeds and absolute positions in, raw logits out.

    forward(inputs_embeds [b, s, hidden], positions [b, s], seq_ids [b] (each row's KV slot of
    `slots`; None: batch 1)) -> logits [b, s, vocab], with capture=True also the capture points."""

    layer_class = DecoderLayer  # model_blocks.FamilyRankDecoder runs the gemma4 family's layers

    def __init__(self, spec: ModelSpec, tp: int = 1, max_len: int = DEFAULT_KV_LEN, dtype=torch.bfloat16,
                 linears: RankLinears | None = None, sliding_cache: str = "linear", slots: int = 1):
        super().__init__()
        linears = linears or RankLinears()
        plans = plan_model(spec, tp)
        self.spec, self.tp, self.max_len, self.dtype, self.slots = spec, tp, max_len, dtype, slots
        self.sliding_cache = sliding_cache
        self.layers = nn.ModuleList(
            self.layer_class(spec, layer, plan, linears, max_len=max_len, dtype=dtype) for layer, plan in zip(spec.layers, plans)
        )
        for layer, plan, block in zip(spec.layers, plans, self.layers):
            if layer.kv_source is None:  # a KV-shared layer (model_blocks) reads its source's cache
                block.self_attn.cache = make_cache(sliding_cache, layer, plan.kv_heads_per_rank, max_len, dtype, slots=slots)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = linears.vocab(spec.hidden_size, spec.vocab_size // tp)
        self.to(dtype)

    def reset_cache(self):
        for layer in self.layers:
            layer.self_attn.cache.k.zero_()
            layer.self_attn.cache.v.zero_()
        self.set_kv_read(None)

    def set_kv_read(self, length: int | None) -> None:
        """Linear caches read their first `length` slots (None: all) until told otherwise: the KV
        bucket of the graph about to run. A ring always reads its window plus the chunk."""
        for layer in self.layers:
            layer.self_attn.cache.read_len = length

    def set_seq_ids(self, seq_ids: torch.Tensor | None) -> None:  # each row's KV slot; None: batch 1
        for cache in (m for m in self.modules() if isinstance(m, KVCache)):
            cache.seq_ids = seq_ids

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False, seq_ids=None):
        self.set_seq_ids(seq_ids)
        captures = {"embeddings": inputs_embeds} if capture else None
        x = self.final_hidden(inputs_embeds, positions, captures)
        logits = self.lm_head(x)
        if capture:
            captures["final_norm"] = x
            return logits, captures
        return logits

    def final_hidden(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, captures=None) -> torch.Tensor:
        """The decoder layers and the final norm: lm_head's input [1, s, hidden]. Fills `captures`
        (when given) with each layer's points."""
        return self.norm(self.run_layers(inputs_embeds, positions, 0, len(self.layers), captures))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, start: int, stop: int,
                   captures: dict | None = None) -> torch.Tensor:
        """Layers [start, stop) on hidden states x [1, s, hidden] at absolute `positions`: the masks,
        rope and cache writes of the whole-model forward (which runs all layers through here), so a
        layer run alone (the local verdict) takes exactly the path it takes inside the model."""
        masks = {}
        for i in range(start, stop):
            window = self.spec.layers[i].window
            cache = self.layers[i].self_attn.cache
            key = (window, type(cache))
            if key not in masks:  # a ring's keys are its slots then the chunk: their own mask
                masks[key] = attention_mask(positions, cache.key_positions(positions), window, x.dtype)
            cos, sin = rope_cos_sin(rope_inv_freq(self.spec.layers[i], positions.device), positions, x.dtype)
            x = self.layers[i](x, cos, sin, positions, masks[key], captures, f"layers.{i}.")
            if captures is not None:
                captures[f"layers.{i}.output"] = x
        return x
