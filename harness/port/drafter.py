"""The assistant's per-rank module (the drafter), built like the target's: query heads split across
ranks, MLP column/row parallel, small projections replicated. It has no KV cache of its own: every
layer reads the target's cache slots of the target's "store" layer of its type (the rank's own KV
heads, as the target's sharding placed them), at the drafting position, keys [0, position) only.

One call drafts one token at one position: inputs are the target's scaled embedding of the last
token and a hidden state (the target's final-norm output, or the drafter's own post-projection on
later steps of a round), concatenated embedding first; outputs the raw logits [1, 1, vocab] and the
post-projected state. The masked head gathers the chosen clusters' token rows by index and scatters
their logits into a vocabulary row filled below every candidate: static shapes throughout.
docs/speculative.md."""

from __future__ import annotations

import torch
from torch import nn

from harness.port.model import MLP, RankLinears, RMSNorm, apply_rope, attention_mask, eager_attention, rope_cos_sin, rope_inv_freq
from harness.port.sharding import LayerPlan, plan_layer, shard_layer

DRAFTER_PREFIX = "drafter."


def join_inputs(embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """pre_projection's input: the token's embedding first, then the hidden state."""
    return torch.cat([embeds, hidden], dim=-1)


def window_keys(window: int | None) -> int | None:
    """How many of the latest keys a drafter's sliding layer reads: window + 1. transformers' assistant
    masks its sliding layers bidirectionally (|i - j| <= window, over the keys flipped to face the
    past), one key more than the target's own causal window (docs/speculative.md)."""
    return None if window is None else window + 1


class DraftAttention(nn.Module):
    """Queries only; keys and values are the target's (already normed and roped)."""

    def __init__(self, layer, plan: LayerPlan, hidden: int, eps: float, linears: RankLinears):
        super().__init__()
        self.head_dim, self.q_heads, self.groups = layer.head_dim, plan.q_heads_per_rank, plan.groups
        self.q_proj = linears.column(hidden, self.q_heads * layer.head_dim)
        self.q_norm = RMSNorm(layer.head_dim, eps)
        self.o_proj = linears.row(self.q_heads * layer.head_dim, hidden)

    def forward(self, x, cos, sin, kv, mask):
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.q_heads, self.head_dim)), cos, sin).transpose(1, 2)
        return self.o_proj(eager_attention(q, kv, mask, self.groups))


class DraftLayer(nn.Module):
    def __init__(self, aspec, layer, plan: LayerPlan, linears: RankLinears):
        super().__init__()
        h, eps = aspec.hidden_size, aspec.rms_norm_eps
        self.spec = layer
        self.self_attn = DraftAttention(layer, plan, h, eps, linears)
        self.mlp = MLP(_MLPShape(h, aspec.intermediate_size), plan.tp, linears)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, position, kv, mask):
        cos, sin = rope_cos_sin(rope_inv_freq(self.spec, position.device), position, x.dtype)
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, mask))
        out = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return out * self.layer_scalar.to(out.dtype)


class _MLPShape:
    """What model.MLP reads of a spec."""

    def __init__(self, hidden: int, intermediate: int):
        self.hidden_size, self.intermediate_size = hidden, intermediate


class MaskedHead(nn.Module):
    """use_ordered_embeddings: score only the tokens of the top-k centroids (gathered by index)."""

    def __init__(self, aspec):
        super().__init__()
        self.top_k, self.vocab = aspec.top_k_centroids, aspec.vocab_size
        self.centroids = nn.Linear(aspec.hidden_size, aspec.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(aspec.vocab_size, dtype=torch.int32))  # int32 at the boundary
        self.per_centroid = aspec.per_centroid

    def forward(self, x, head_weight):
        """x [1, 1, h] -> (logits [1, 1, vocab], chosen clusters [1, 1, top_k])."""
        clusters = torch.topk(self.centroids(x), self.top_k, dim=-1).indices
        members = self.token_ordering.view(-1, self.per_centroid).index_select(0, clusters.reshape(-1))
        ids = members.reshape(-1).to(torch.long)  # [top_k * per_centroid], static; widened in the graph
        scores = torch.matmul(x, head_weight.index_select(0, ids).T)  # [1, 1, candidates]
        floor = scores.min() - 1.0
        row = torch.full((1, 1, self.vocab), 0.0, dtype=scores.dtype, device=x.device) + floor
        return row.index_copy(2, ids, scores), clusters


class RankDrafter(nn.Module):
    """One rank's assistant. forward(embeds [1,1,H], hidden [1,1,H], position [1,1], kv: per layer
    (k, v) of the rank's target cache [1, kv_heads, slots, d]) -> (logits, state, captures)."""

    def __init__(self, aspec, tp: int, linears: RankLinears, dtype=torch.bfloat16):
        super().__init__()
        self.aspec, self.tp = aspec, tp
        self.plans = [plan_layer(layer, tp) for layer in aspec.layers]
        self.pre_projection = linears.replicated(2 * aspec.backbone_hidden_size, aspec.hidden_size)
        self.layers = nn.ModuleList(DraftLayer(aspec, layer, plan, linears) for layer, plan in zip(aspec.layers, self.plans))
        self.norm = RMSNorm(aspec.hidden_size, aspec.rms_norm_eps)
        self.lm_head = linears.replicated(aspec.hidden_size, aspec.vocab_size)
        self.post_projection = linears.replicated(aspec.hidden_size, aspec.backbone_hidden_size)
        self.masked_embedding = MaskedHead(aspec) if aspec.ordered else None
        self.to(dtype)
        if self.masked_embedding is not None:
            self.masked_embedding.token_ordering = self.masked_embedding.token_ordering.to(torch.int32)

    def forward(self, embeds, hidden, position, kv, capture: bool = False):
        caps: dict[str, torch.Tensor] = {}
        x = self.pre_projection(join_inputs(embeds, hidden).to(self.pre_projection.weight.dtype))
        caps["pre_projection"] = x
        masks = {}
        for i, layer in enumerate(self.layers):
            spec = self.aspec.layers[i]
            k, v = kv[i]
            if spec.window not in masks:  # keys j with position - window - 1 <= j < position (window_keys)
                masks[spec.window] = attention_mask(position - 1, k.shape[2], window_keys(spec.window), x.dtype)
            x = layer(x, position, (k.to(x.dtype), v.to(x.dtype)), masks[spec.window])
            caps[f"layers.{i}.output"] = x
        x = self.norm(x)
        caps["final_norm"] = x
        state = self.post_projection(x)
        caps["post_projection"] = state
        if self.masked_embedding is None:
            logits = self.lm_head(x)
        else:
            logits, clusters = self.masked_embedding(x, self.lm_head.weight)
            caps["clusters"] = clusters
        caps["logits"] = logits
        return logits, state, ({DRAFTER_PREFIX + k: v for k, v in caps.items()} if capture else {})


def rank_drafter_state(weights: dict[str, torch.Tensor], aspec, tp: int, rank: int, dtype) -> dict[str, torch.Tensor]:
    """One rank's state dict from the assistant checkpoint's tensors (transformers' names)."""
    out = {}
    for i, layer in enumerate(aspec.layers):
        prefix = f"model.layers.{i}."
        mine = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        for name, w in shard_layer(mine, plan_layer(layer, tp), rank).items():
            out[f"layers.{i}.{name}"] = w
    out["norm.weight"] = weights["model.norm.weight"]
    out["lm_head.weight"] = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    for name in ("pre_projection.weight", "post_projection.weight"):
        out[name] = weights[name]
    if aspec.ordered:
        out["masked_embedding.centroids.weight"] = weights["masked_embedding.centroids.weight"]
        out["masked_embedding.token_ordering"] = weights["masked_embedding.token_ordering"].to(torch.int32)
    return {k: (v if k.endswith("token_ordering") else v.to(dtype)) for k, v in out.items()}
