"""Tensor-parallel plan from the spec, and per-rank weight shards: the one place that knows ranks
(gathering them back: harness/port/rank_merge.py).

Query heads are split across ranks. KV heads are sharded when nkv % tp == 0 and replicated when
tp % nkv == 0 (the 12B's full layers: one KV head, copied whole to both ranks); anything else is an
error. A head is never split inside its head_dim: k_norm spans all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.base.errors import ShardingError
from harness.base.settings import DEFAULT_DTYPE, DEFAULT_KV_LEN
from harness.inputs.quantize import port_layer_weights, scheme_of, weight_name
from harness.inputs.spec import LayerSpec, ModelSpec, dtype_bytes
from harness.port.tp_split import split_problems

# Weights split by output rows (per head for attention), by input columns, or copied to every rank.
Q_ROWS = ("self_attn.q_proj.weight",)
KV_ROWS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
Q_COLS = ("self_attn.o_proj.weight",)
MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
MLP_COLS = ("mlp.down_proj.weight",)
# The 26B-A4B's experts are split inside each expert, like the dense MLP (docs/family.md): [E, 2*mi, h] gate|up rows and [E, h, mi] down columns, each rank a 1/tp slice of every expert.
EXPERT_GATE_UP = "experts.gate_up_proj"
EXPERT_DOWN = "experts.down_proj"


@dataclass(frozen=True)
class LayerPlan:
    index: int
    tp: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_layout: str  # "shard" | "replicate"

    @property
    def q_heads_per_rank(self) -> int:
        return self.q_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_heads // self.tp if self.kv_layout == "shard" else 1

    @property
    def groups(self) -> int:
        """Query heads per KV head on one rank: nq / tp / kv_per_rank."""
        return self.q_heads_per_rank // self.kv_heads_per_rank

    def q_heads_for_rank(self, rank: int) -> list[int]:
        n = self.q_heads_per_rank
        return list(range(rank * n, (rank + 1) * n))

    def kv_heads_for_rank(self, rank: int) -> list[int]:
        return kv_heads_for_rank(self, rank)


def kv_heads_for_rank(plan: LayerPlan, rank: int) -> list[int]:
    """The KV heads a rank holds: the ones its query heads read (query head h reads h // group)."""
    group = plan.q_heads // plan.kv_heads
    if plan.kv_layout == "shard":
        n = plan.kv_heads_per_rank
        return list(range(rank * n, (rank + 1) * n))
    return [plan.q_heads_for_rank(rank)[0] // group]


def kv_layout_for(kv_heads: int, tp: int) -> str:
    if kv_heads % tp == 0:
        return "shard"
    if tp % kv_heads == 0:
        return "replicate"
    raise ShardingError(
        f"{kv_heads} KV heads cannot be split across tp={tp}: they shard only when "
        f"kv_heads % tp == 0 and replicate only when tp % kv_heads == 0. Choose a TP degree that "
        "divides or is a multiple of the KV head count."
    )


def _check_tp(tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ShardingError(f"tp must be a positive integer, got {tp!r}")


def plan_layer(layer: LayerSpec, tp: int) -> LayerPlan:
    _check_tp(tp)
    if layer.q_heads % tp:
        raise ShardingError(
            f"layer {layer.index}: {layer.q_heads} query heads do not split across tp={tp}; "
            "use a TP degree that divides the query head count"
        )
    if layer.q_heads % layer.kv_heads:
        raise ShardingError(
            f"layer {layer.index}: {layer.q_heads} query heads are not a multiple of "
            f"{layer.kv_heads} KV heads"
        )
    return LayerPlan(index=layer.index, tp=tp, q_heads=layer.q_heads, kv_heads=layer.kv_heads,
                     head_dim=layer.head_dim, kv_layout=kv_layout_for(layer.kv_heads, tp))


def plan_model(spec: ModelSpec, tp: int) -> list[LayerPlan]:
    _check_tp(tp)
    problems = split_problems(spec, tp)
    if problems:  # every size at once, so one run names all a config must change
        raise ShardingError(f"tp={tp} does not split {len(problems)} of the model's sizes: {'; '.join(problems)}")
    return [plan_layer(layer, tp) for layer in spec.layers]


def _heads(weight: torch.Tensor, heads: list[int], head_dim: int, dim: int) -> torch.Tensor:
    """Whole heads [h*head_dim, (h+1)*head_dim) along `dim`, never a slice inside a head."""
    index = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])
    return weight.index_select(dim, index).contiguous()


def shard_layer(weights: dict[str, torch.Tensor], plan: LayerPlan, rank: int) -> dict[str, torch.Tensor]:
    """One rank's slice of one decoder layer's weights (names relative to the layer)."""
    d = plan.head_dim
    q_heads, kv_heads = plan.q_heads_for_rank(rank), kv_heads_for_rank(plan, rank)
    out = {}
    for name, w in weights.items():
        # A quantized weight's per-output-row scale (harness/inputs/quantize.py) goes with its rows:
        # split like a row-split weight's rows, replicated beside a column-split one.
        rows_of = weight_name(name) or name
        if rows_of in Q_ROWS:
            out[name] = _heads(w, q_heads, d, 0)
        elif rows_of in KV_ROWS:
            out[name] = _heads(w, kv_heads, d, 0)
        elif name in Q_COLS:
            out[name] = _heads(w, q_heads, d, 1)
        elif rows_of in MLP_ROWS:
            out[name] = w.chunk(plan.tp, 0)[rank].contiguous()
        elif name in MLP_COLS:
            out[name] = w.chunk(plan.tp, 1)[rank].contiguous()
        elif name == EXPERT_GATE_UP:
            gate, up = w.chunk(2, 1)
            out[name] = torch.cat([gate.chunk(plan.tp, 1)[rank], up.chunk(plan.tp, 1)[rank]], 1).contiguous()
        elif name == EXPERT_DOWN:
            out[name] = w.chunk(plan.tp, 2)[rank].contiguous()
        else:  # norms, layer_scalar, the router and the per-layer input's gate are replicated
            out[name] = w.clone()
    return out


def shard_lm_head(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The tied lm_head split by vocabulary rows; ranks' logits are gathered on the last dim."""
    return weight.chunk(tp, 0)[rank].contiguous()


def rank_state_dicts(checkpoint, tp: int, dtype: torch.dtype | None = None,
                     quantize: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Per-rank state dicts for model.RankDecoder, streamed one layer at a time from `checkpoint`;
    with `quantize` (a scheme of harness/inputs/quantize.py), the quantized layers' int8 weights
    and scales (harness/port/quantized.py)."""
    plans = plan_model(checkpoint.spec, tp)
    scheme = scheme_of(quantize)
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for plan in plans:
        weights = (checkpoint.layer_weights(plan.index, dtype) if scheme is None
                   else port_layer_weights(checkpoint, plan.index, scheme, dtype))
        for rank in range(tp):
            for name, tensor in shard_layer(weights, plan, rank).items():
                states[rank][f"layers.{plan.index}.{name}"] = tensor
        del weights
    norm = checkpoint.final_norm_weight(dtype)
    lm_head = checkpoint.lm_head_weight(dtype)
    # The per-layer inputs' projection (E2B/E4B); checkpoint-like wrappers without it have none.
    model_level = checkpoint.device_model_weights(dtype) if checkpoint.spec.per_layer_input_size else {}
    for rank in range(tp):
        states[rank]["norm.weight"] = norm.clone()
        states[rank]["lm_head.weight"] = shard_lm_head(lm_head, tp, rank)
        states[rank].update({f"per_layer.{name}": w.clone() for name, w in model_level.items()})  # model_blocks
    return states


def ring_windows(spec: ModelSpec, sliding_cache: str, max_len: int) -> dict[int, int]:
    """Layer index -> window of the layers kept in a ring of `window` slots (kv_cache.make_cache)."""
    if sliding_cache != "ring":
        return {}
    return {layer.index: layer.window for layer in spec.layers if layer.is_sliding and layer.window < max_len}


# ---- device memory per rank ------------------------------------------------------------------------

def layer_params_per_rank(spec: ModelSpec, layer: LayerSpec, tp: int) -> int:
    """Parameters one rank holds for a layer under the TP plan (kv replicated or sharded; a
    KV-shared layer has no k/v projections; PLE gate and router replicated, experts split)."""
    plan = plan_layer(layer, tp)
    h, d = spec.hidden_size, layer.head_dim
    q = h * plan.q_heads_per_rank * d * 2  # q_proj + o_proj
    shared = layer.kv_source is not None
    kv = 0 if shared else h * plan.kv_heads_per_rank * d * (1 if layer.k_eq_v else 2)
    mlp = 3 * h * spec.mlp_size(layer) // tp
    norms = 4 * h + (1 if shared else 2) * d + 1  # four layer norms, q (and k) norm, layer_scalar
    ple = 2 * h * spec.per_layer_input_size + h if spec.per_layer_input_size else 0
    moe = 0
    if spec.moe is not None:
        e = spec.moe.num_experts
        moe = e * h + h + e + 3 * e * spec.moe.intermediate_size * h // tp + 3 * h
    return q + kv + mlp + norms + ple + moe


def bytes_per_rank(spec: ModelSpec, tp: int, dtype: str = DEFAULT_DTYPE, kv_len: int = DEFAULT_KV_LEN,
                   sliding_cache: str = "linear") -> dict:
    """Device bytes per rank: weights (lm_head split by vocab) plus the KV cache at kv_len (sliding
    layers' rings at their window when `sliding_cache` is "ring"; see kv_cache_bytes)."""
    nbytes = dtype_bytes(dtype)
    weights = sum(layer_params_per_rank(spec, layer, tp) for layer in spec.layers)
    weights += spec.vocab_size * spec.hidden_size // tp + spec.hidden_size  # lm_head split + final norm
    packed = spec.num_layers * spec.per_layer_input_size
    weights += packed * spec.hidden_size + spec.per_layer_input_size  # PLE projection + norm, replicated
    cache = kv_cache_bytes(spec, tp, dtype, sliding_cache)
    kv = (cache["per_token"] * kv_len + cache["ring"]) // nbytes
    # The packed per-layer table is vocabulary-sized (E2B: 262144 x 35*256): host-side, like the
    # word embeddings; the device gets each token's row.
    host_embeddings = spec.vocab_size * spec.hidden_size + spec.per_layer_vocab_size * packed
    return {
        "weights": weights * nbytes,
        "kv_cache": kv * nbytes,
        "total": (weights + kv) * nbytes,
        "host_embeddings": host_embeddings * nbytes,
    }


def kv_cache_bytes(spec: ModelSpec, tp: int, dtype: str = "bfloat16", sliding_cache: str = "linear") -> dict:
    """One rank's KV cache cost: `per_token` bytes of the layers with a linear cache (every layer, or
    the full layers only when sliding layers keep a ring) and the `ring` bytes of the sliding layers'
    rings, fixed at window slots whatever the context."""
    nbytes, per_token, ring = dtype_bytes(dtype), 0, 0
    for layer in spec.layers:
        if layer.kv_source is not None:  # a KV-shared layer reads its source layer's cache: no cache of its own
            continue
        row = 2 * plan_layer(layer, tp).kv_heads_per_rank * layer.head_dim * nbytes  # k and v of one position
        if sliding_cache == "ring" and layer.is_sliding:
            ring += row * layer.window
        else:
            per_token += row
    return {"per_token": per_token, "ring": ring}


def memory_plan(spec: ModelSpec, tp: int, dtype: str, kv_len: int, *, device_bytes: int, ranks_per_device: int,
                device: str, reserve_bytes: int = 0, weights_per_rank: int | None = None) -> dict:
    """Device memory of one `device` (`device_bytes` shared by `ranks_per_device` ranks) for both
    sliding caches: weights, KV bytes per token, the rings' fixed bytes, the KV bytes at kv_len and
    the longest context that fits next to the weights and `reserve_bytes` per rank (the compiled
    graphs: core_fit.graph_reserve_bytes), capped at the model's positions. `weights_per_rank`: the
    weights as they load when not `dtype`'s (int8 under --quantize: core_fit.weight_bytes)."""
    if weights_per_rank is None:
        weights_per_rank = bytes_per_rank(spec, tp, dtype, 0)["weights"]
    weights = weights_per_rank * ranks_per_device
    reserve = reserve_bytes * ranks_per_device
    caches = {}
    for kind in ("linear", "ring"):
        cost = {k: v * ranks_per_device for k, v in kv_cache_bytes(spec, tp, dtype, kind).items()}
        room = device_bytes - weights - reserve - cost["ring"]
        by_memory = max(room // cost["per_token"], 0) if cost["per_token"] else 0
        longest = by_memory if spec.max_positions is None else min(by_memory, spec.max_positions)
        total = weights + reserve + cost["ring"] + cost["per_token"] * kv_len
        caches[kind] = {"kv_bytes_per_token": cost["per_token"], "ring_bytes": cost["ring"],
                        "kv_bytes_at_kv_len": cost["ring"] + cost["per_token"] * kv_len,
                        "total_bytes": total, "longest_by_memory": int(by_memory),
                        "longest_context": int(longest), "fits": kv_len <= longest}
    return {"device": device, "device_bytes": device_bytes, "ranks_per_device": ranks_per_device,
            "max_positions": spec.max_positions,
            "weights_bytes": weights, "graphs_reserve_bytes": reserve, "kv_len": kv_len, "caches": caches}


def plan_summary(spec: ModelSpec, tp: int, dtype: str = DEFAULT_DTYPE, kv_len: int = DEFAULT_KV_LEN) -> dict:
    """The resolved spec with each layer's TP plan and the device bytes per rank (what `info` shows)."""
    layers = []
    for layer in spec.layers:
        plan = plan_layer(layer, tp)
        layers.append({"index": layer.index, "type": layer.type, "head_dim": layer.head_dim,
                       "q_heads": layer.q_heads, "kv_heads": layer.kv_heads, "k_eq_v": layer.k_eq_v,
                       "window": layer.window, "rope_type": layer.rope_type, "rope_theta": layer.rope_theta,
                       "rotated_freqs": layer.rotated_freqs, "q_heads_per_rank": plan.q_heads_per_rank,
                       "kv_heads_per_rank": plan.kv_heads_per_rank, "groups": plan.groups,
                       "kv_layout": plan.kv_layout})
    memory = bytes_per_rank(spec, tp, dtype, kv_len)
    return {"spec_hash": spec.spec_hash(), "source": spec.source, "tp": tp, "dtype": dtype,
            "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
            "final_logit_softcapping": spec.final_logit_softcapping, "inert": spec.describe_inert(),
            "layers": layers, "bytes_per_rank": memory["total"], "memory": memory}
