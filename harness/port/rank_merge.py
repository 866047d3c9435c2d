"""The inverse of harness/port/sharding.py's split: the ranks' weight shards and KV caches gathered
back into the model's own order (one copy of each replicated head), for the tests of the plan and
for reading the cache back (Engine.read_cache)."""

from __future__ import annotations

import torch

from harness.inputs.quantize import weight_name
from harness.inputs.spec import ModelSpec
from harness.port import sharding  # through the module: a patched head plan reads back as it was loaded
from harness.port.sharding import EXPERT_DOWN, EXPERT_GATE_UP, KV_ROWS, MLP_COLS, MLP_ROWS, Q_COLS, Q_ROWS, LayerPlan


def merge_layer_shards(shards: list[dict[str, torch.Tensor]], plan: LayerPlan) -> dict[str, torch.Tensor]:
    """Inverse of shard_layer: concatenate the ranks' pieces (one copy of each replicated head)."""
    d = plan.head_dim
    merged = {}
    for name in shards[0]:
        rows_of = weight_name(name) or name  # a scale merges as its weight's rows (shard_layer)
        if rows_of in Q_ROWS:
            merged[name] = torch.cat([s[name] for s in shards], 0)
        elif name in Q_COLS:
            merged[name] = torch.cat([s[name] for s in shards], 1)
        elif rows_of in KV_ROWS:
            by_head = {}
            for rank, s in enumerate(shards):
                for j, h in enumerate(sharding.kv_heads_for_rank(plan, rank)):
                    by_head.setdefault(h, s[name][j * d:(j + 1) * d])
            merged[name] = torch.cat([by_head[h] for h in sorted(by_head)], 0)
        elif rows_of in MLP_ROWS:
            merged[name] = torch.cat([s[name] for s in shards], 0)
        elif name in MLP_COLS:
            merged[name] = torch.cat([s[name] for s in shards], 1)
        elif name == EXPERT_GATE_UP:
            halves = [s[name].chunk(2, 1) for s in shards]
            merged[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 1)
        elif name == EXPERT_DOWN:
            merged[name] = torch.cat([s[name] for s in shards], 2)
        else:
            merged[name] = shards[0][name]
    return merged



def cache_slots(written: int, window: int | None) -> torch.Tensor:
    """Cache slots holding the positions a cache still has after `written` writes, oldest first:
    [0, written) of a linear cache; the last `window` positions of a ring (position p in slot
    p % window), so a ring reads back in absolute-position order."""
    if window is None:
        return torch.arange(written)
    return torch.arange(max(written - window, 0), written) % window


def merge_rank_caches(spec: ModelSpec, tp: int, kv_cache, written: int,
                      rings: dict[int, int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's KV cache at the positions it holds after `written` writes ([0, written) for a
    linear cache, the last window positions of a ring layer in `rings`: layer -> window), merged
    over ranks by the plan into the model's KV head order (one copy of a replicated head): per
    layer (k, v), each [kv_heads, held, head_dim] fp32, oldest position first. `kv_cache(layer,
    rank)` gives one rank's (k, v), [1, heads, slots, d]."""
    merged = []
    for i, plan in enumerate(sharding.plan_model(spec, tp)):
        if spec.layers[i].kv_source is not None:  # a KV-shared layer (model_blocks) holds none: None
            merged.append(None)
            continue
        slots = cache_slots(written, (rings or {}).get(i))
        parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for rank in range(tp):
            k, v = kv_cache(i, rank)
            for slot, head in enumerate(sharding.kv_heads_for_rank(plan, rank)):
                parts.setdefault(head, (k[0, slot, slots], v[0, slot, slots]))
        heads = sorted(parts)
        merged.append((torch.stack([parts[h][0] for h in heads]).float(),
                       torch.stack([parts[h][1] for h in heads]).float()))
    return merged
