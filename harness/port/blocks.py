"""The Gemma-4 family's extra blocks on one rank: per-layer inputs (E2B/E4B), KV-shared attention,
the mixture-of-experts block (26B-A4B), and the decoder that runs them.

The numerics follow transformers' modeling_gemma4 (Gemma4TextModel.project_per_layer_inputs,
Gemma4TextDecoderLayer.forward, Gemma4TextRouter, Gemma4TextExperts). Everything here has static
shapes: the experts a token uses are gathered by index (k of them, always k) in decode, or every
expert runs with zero weights where not chosen (prefill), never a data-dependent mask or count.

Device input: for a model with per-layer inputs the host appends each token's row of the packed
per-layer table (already scaled, as transformers' scaled embedding does) to the word embedding, so
the graph's one input is [1, s, hidden + layers * per_layer_input]. The table itself is
vocabulary-sized and stays on the host like the word embeddings (docs/family.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.port.model import (MLP, Collectives, DecoderLayer, RankDecoder, RankLinears, RMSNorm, apply_rope,
                                attention_mask, eager_attention, rms_norm, rope_cos_sin, rope_inv_freq)
from harness.inputs.spec import LayerSpec, ModelSpec
from harness.port.device_plan import EXPERT_BLOCK, moe_gathers
from harness.port.sharding import LayerPlan

PLE_COMBINE = 2.0 ** -0.5  # (projection + table row) / sqrt(2): transformers' per_layer_input_scale


def per_layer_rows(table: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """Host side: each token's row of the packed per-layer table, times sqrt(per_layer_input)
    cast to the table's dtype first (transformers' scaled embedding)."""
    return table[ids] * torch.tensor(width ** 0.5).to(table.dtype)


class PerLayerInputs(nn.Module):
    """The context half of the per-layer inputs, combined with the token half from the host:
    norm(W e / sqrt(hidden)) reshaped per layer, plus the table row, times 1/sqrt(2)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.layers, self.width = spec.num_layers, spec.per_layer_input_size
        self.scale = spec.hidden_size ** -0.5
        # Replicated on every rank: layers * per_layer_input outputs are few (E2B: 8960) next to the
        # decoder, and a split would cost an all-gather before the per-layer reshape.
        self.per_layer_model_projection = nn.Linear(spec.hidden_size, self.layers * self.width, bias=False)
        self.per_layer_projection_norm = RMSNorm(self.width, spec.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        """embeds [b, s, hidden], table_rows [b, s, layers * width] -> [b, s, layers, width]."""
        b, s, _ = embeds.shape
        projected = (self.per_layer_model_projection(embeds) * self.scale).view(b, s, self.layers, self.width)
        projected = self.per_layer_projection_norm(projected)
        return (projected + table_rows.view(b, s, self.layers, self.width)) * PLE_COMBINE


class SharedKVAttention(nn.Module):
    """Attention of a KV-shared layer: its own queries over its source layer's cache. No k/v
    projections, no cache of its own, no cache write (the graph contracts count none)."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, plan: LayerPlan, linears: RankLinears):
        super().__init__()
        d, h = layer.head_dim, spec.hidden_size
        self.head_dim, self.groups, self.q_heads = d, plan.groups, plan.q_heads_per_rank
        self.source_index = layer.kv_source
        self.q_proj = linears.column(h, self.q_heads * d)
        self.o_proj = linears.row(self.q_heads * d, h)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self._source: list = []  # the source layer's attention; a list so it is not a submodule

    def bind(self, source_attention: nn.Module) -> None:
        self._source[:] = [source_attention]

    @property
    def source_cache(self):
        return self._source[0].cache

    def forward(self, x, cos, sin, positions, mask):
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.q_heads, self.head_dim)), cos, sin).transpose(1, 2)
        # What the source's attention read in this call (it runs first): the same slots of a linear
        # cache, or a ring as it was before this chunk followed by the chunk's own keys.
        return self.o_proj(eager_attention(q, self.source_cache.last_read, mask, self.groups))


class Router(nn.Module):
    """Scale-free RMSNorm, learned scale and 1/sqrt(hidden), linear, fp32 softmax, top-k
    renormalised, per-expert scale. Replicated: every rank routes the same way."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h = spec.moe.num_experts, spec.hidden_size
        self.top_k, self.eps, self.root = spec.moe.top_k, spec.rms_norm_eps, h ** -0.5
        self.proj = nn.Linear(h, e, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(e))

    def forward(self, x: torch.Tensor):
        """x [t, hidden] -> (logits [t, E], weights [t, k] fp32, chosen [t, k])."""
        logits = self.proj(rms_norm(x, None, self.eps) * self.scale * self.root)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights * self.per_expert_scale[chosen], chosen


class Experts(nn.Module):
    """Every expert's 1/tp slice (split inside each expert, like the dense MLP). As NxD does
    (harness/port/device_plan.py): where tokens x top-k < experts (decode) a token's k chosen experts'
    weights are gathered by index; otherwise (prefill) every token runs through every expert,
    EXPERT_BLOCK experts at a time, and the routing weights (zero where not chosen) select the
    outputs. Shapes never depend on the routing."""

    def __init__(self, spec: ModelSpec, tp: int, collectives: Collectives):
        super().__init__()
        e, h, mi = spec.moe.num_experts, spec.hidden_size, spec.moe.intermediate_size // tp
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * mi, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, mi))
        self.collectives = collectives

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [t, hidden], weights/chosen [t, k] -> [t, hidden]: sum of weighted expert outputs."""
        t, k = chosen.shape
        if moe_gathers(t, k, self.gate_up_proj.shape[0]):  # static per graph: the trace fixes the branch
            partial = self.gathered(x, weights, chosen)
        else:
            partial = self.all_experts(x, torch.zeros(t, self.gate_up_proj.shape[0], dtype=torch.float32,
                                                      device=x.device).scatter(-1, chosen, weights))
        return self.collectives.all_reduce(partial).to(x.dtype)

    @staticmethod
    def weighted(out: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
        """Weighted in fp32 and cast per expert, as transformers' experts loop does, then summed in fp32."""
        return (out.float() * weights[..., None]).to(dtype).float().sum(dim=1)

    def gathered(self, x, weights, chosen):
        gate, up = torch.einsum("th,tkoh->tko", x, self.gate_up_proj[chosen]).chunk(2, dim=-1)
        out = torch.einsum("tki,tkhi->tkh", F.gelu(gate, approximate="tanh") * up, self.down_proj[chosen])
        return self.weighted(out, weights, x.dtype)

    def all_experts(self, x, dense):
        """dense [t, E] fp32 routing weights (zero where not chosen): every expert, a block at a time."""
        partial = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for start in range(0, dense.shape[1], EXPERT_BLOCK):
            stop = min(start + EXPERT_BLOCK, dense.shape[1])
            gate, up = torch.einsum("th,eoh->teo", x, self.gate_up_proj[start:stop]).chunk(2, dim=-1)
            out = torch.einsum("tei,ehi->teh", F.gelu(gate, approximate="tanh") * up, self.down_proj[start:stop])
            partial = partial + self.weighted(out, dense[:, start:stop], x.dtype)
        return partial


class FamilyDecoderLayer(DecoderLayer):
    """A gemma4 decoder layer: the 12B's layer plus, where the spec has them, KV-shared attention,
    the MoE block beside the dense MLP, and the per-layer input after the MLP."""

    def __init__(self, spec, layer: LayerSpec, plan: LayerPlan, linears, max_len, dtype):
        super().__init__(spec, layer, plan, linears, max_len=max_len, dtype=dtype)
        eps, h = spec.rms_norm_eps, spec.hidden_size
        self.ple = bool(spec.per_layer_input_size)
        if self.ple:  # the per-layer input, added after the MLP: norm(P(gelu(G h) * input))
            self.per_layer_input_gate = nn.Linear(h, spec.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(spec.per_layer_input_size, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.moe = spec.moe is not None
        if self.moe:
            self.router = Router(spec)
            self.experts = Experts(spec, plan.tp, linears.collectives)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)

    def make_attention(self, spec, layer, plan, linears, max_len, dtype) -> nn.Module:
        if layer.kv_source is None:
            return super().make_attention(spec, layer, plan, linears, max_len=max_len, dtype=dtype)
        return SharedKVAttention(spec, layer, plan, linears)

    def feed_forward(self, h: torch.Tensor, captures, prefix: str) -> torch.Tensor:
        """The dense MLP, and on MoE layers the experts beside it, each with its own norms."""
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if not self.moe:
            return out
        flat = h.reshape(-1, h.shape[-1])
        logits, weights, chosen = self.router(flat)
        experts = self.experts(self.pre_feedforward_layernorm_2(flat), weights, chosen).view(h.shape)
        if captures is not None:
            captures[prefix + "router_logits"] = logits.view(*h.shape[:-1], -1)
            dense = torch.zeros_like(logits, dtype=torch.float32).scatter(-1, chosen, weights)
            captures[prefix + "expert_weights"] = dense.view(*h.shape[:-1], -1)
        return self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)

    def forward(self, x, cos, sin, positions, mask, captures=None, prefix="", per_layer_input=None):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, positions, mask))
        out = h + self.post_feedforward_layernorm(self.feed_forward(h, captures, prefix))
        if captures is not None:
            captures[prefix + "attn_residual"] = h
            captures[prefix + "mlp_residual"] = out
        if self.ple:
            gated = F.gelu(self.per_layer_input_gate(out), approximate="tanh") * per_layer_input
            if captures is not None:
                captures[prefix + "per_layer_input"] = gated
            out = out + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return out * self.layer_scalar.to(out.dtype)


class FamilyRankDecoder(RankDecoder):
    """One rank's gemma4 decoder: the 12B's, with the family's layers, per-layer inputs, and
    KV-shared layers bound to their source layer's cache."""

    layer_class = FamilyDecoderLayer

    def __init__(self, spec: ModelSpec, tp: int = 1, max_len: int = 256, dtype=torch.bfloat16,
                 linears: RankLinears | None = None, sliding_cache: str = "linear", slots: int = 1):
        super().__init__(spec, tp, max_len, dtype, linears=linears, sliding_cache=sliding_cache, slots=slots)
        self.per_layer = PerLayerInputs(spec).to(dtype) if spec.per_layer_input_size else None
        for layer in spec.layers:
            if layer.kv_source is not None:
                self.layers[layer.index].self_attn.bind(self.layers[self.source_of(layer)].self_attn)

    def source_of(self, layer: LayerSpec) -> int:
        """The layer whose cache a KV-shared layer reads (the spec's, derived as transformers does)."""
        return layer.kv_source

    @staticmethod
    def layer_input(per_layer: torch.Tensor, index: int) -> torch.Tensor:
        """Layer `index`'s slice [b, s, per_layer_input] of the combined per-layer inputs."""
        return per_layer[:, :, index]

    def set_kv_read(self, length: int | None) -> None:
        for layer in self.layers:
            cache = getattr(layer.self_attn, "cache", None)  # a KV-shared layer reads its source's
            if cache is not None:
                cache.read_len = length

    def reset_cache(self):
        for layer in self.layers:
            cache = getattr(layer.self_attn, "cache", None)
            if cache is not None:
                cache.k.zero_()
                cache.v.zero_()
        self.set_kv_read(None)  # as RankDecoder's: a layer run alone after reset reads the whole cache

    def _split(self, inputs: torch.Tensor) -> torch.Tensor:
        """The word embeddings of a device input; its per-layer rows become this call's per-layer inputs."""
        h = self.spec.hidden_size
        embeds = inputs[..., :h]
        self._per_layer_inputs = self.per_layer(embeds, inputs[..., h:]) if self.per_layer is not None else None
        return embeds

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False, seq_ids=None):
        return super().forward(self._split(inputs_embeds), positions, capture, seq_ids)

    def final_hidden(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, captures=None) -> torch.Tensor:
        if inputs_embeds.shape[-1] != self.spec.hidden_size:  # called directly with the device input
            inputs_embeds = self._split(inputs_embeds)
        return super().final_hidden(inputs_embeds, positions, captures)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, start: int, stop: int,
                   captures: dict | None = None) -> torch.Tensor:
        per_layer = getattr(self, "_per_layer_inputs", None)
        masks = {}
        for i in range(start, stop):  # RankDecoder.run_layers, with each layer's per-layer input
            window = self.spec.layers[i].window
            attn = self.layers[i].self_attn
            cache = getattr(attn, "cache", None) or attn.source_cache
            key = (window, type(cache))
            if key not in masks:
                masks[key] = attention_mask(positions, cache.key_positions(positions), window, x.dtype)
            cos, sin = rope_cos_sin(rope_inv_freq(self.spec.layers[i], positions.device), positions, x.dtype)
            ple = self.layer_input(per_layer, i) if per_layer is not None else None
            x = self.layers[i](x, cos, sin, positions, masks[key], captures=captures, prefix=f"layers.{i}.",
                               per_layer_input=ple)
            if captures is not None:
                captures[f"layers.{i}.output"] = x
        return x


def rank_decoder(spec: ModelSpec, **kwargs) -> RankDecoder:
    """The per-rank decoder for this spec: the 12B's, or the family's (same module code on every backend)."""
    return (FamilyRankDecoder if spec.uses_family_blocks else RankDecoder)(spec, **kwargs)


__all__ = ["FamilyRankDecoder", "MLP", "rank_decoder"]
