"""One port layer run alone: the one place that sets a rank module's state by hand (its cache zeroed
or kept as loaded, the keys it reads, one sequence in slot 0, the per-layer inputs) and runs the
decoder's own `run_layers` for that layer, so the layer takes the path it takes inside the model;
and the routes transformers' layer alone follows (the one forcing rule, reference.forcing).

Callers: the local verdicts (parity/local.py: every rank, the engine's prefill chunks), the
bit-exact stage and its snapshot (parity/layer_bits.py, snapshot/bits.py: TP 1, one chunk of
exactly n keys), `replay --layer` (snapshot/replay.py: the recorded positions over the recorded
cache rows) and the repro's traced layer (snapshot/traced_layer.py: the cache as explicit inputs).
tests/unit/test_seam.py fails a second place that drives a layer alone.
"""

from __future__ import annotations

import torch

from harness.port.engine import chunk_plan, chunk_positions
from harness.reference.forcing import follow_routes


def run_layer(module, index: int, rows: torch.Tensor, positions: torch.Tensor, *, fresh: bool = True,
              kv_read: int | None = None, per_layer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Layer `index` of rank module `module` alone on rows [1, s, hidden] at `positions` [1, s]: its
    captures as run_layers writes them ([1, s, ...]). `fresh`: the cache zeroed first (else read as
    loaded or as the earlier chunks left it); `kv_read`: the keys a linear cache reads (None: all);
    `per_layer`: the decoder's per-layer inputs [1, s, layers, width] (None: none)."""
    module._per_layer_inputs = per_layer  # FamilyRankDecoder.run_layers reads it; never a stale call's
    if fresh:
        module.reset_cache()
    module.set_seq_ids(None)  # one sequence in slot 0: not the slots the last batched call named
    module.set_kv_read(kv_read)
    captures: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            module.run_layers(rows.to(module.dtype), positions, index, index + 1, captures)
    finally:
        module.set_kv_read(None)
    return captures


def port_layer_captures(backend, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer `index` of the port (every rank's shard, real all-reduce) alone on x [n, hidden] from a
    zeroed cache, in the engine's prefill chunks and positions (a backend built with buckets), so a
    wiring error in chunked prefill shows in the layer's local verdict too: its points [n, ...] fp32."""
    n = x.shape[0]
    buckets = getattr(backend, "buckets", None)
    chunks = chunk_plan(n, buckets, backend.max_len) if buckets else [(0, n, n)]

    def step(rank):
        module = backend.ranks[rank]
        captures: dict[str, list[torch.Tensor]] = {}
        for j, (start, length, bucket) in enumerate(chunks):
            rows = torch.zeros(1, bucket, x.shape[1], dtype=module.dtype)
            rows[0, :length] = x[start:start + length].to(module.dtype)
            chunk = run_layer(module, index, rows, chunk_positions(start, length, bucket), fresh=j == 0)
            for k, v in chunk.items():
                captures.setdefault(k, []).append(v[0, :length].float())
        return {k: torch.cat(v) for k, v in captures.items()}

    return backend.on_ranks(step)[0]


def port_layer_exact(module, index: int, x: torch.Tensor, per_layer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Layer `index` of a TP 1 module alone on x [n, hidden] (and the per-layer inputs [n, layers,
    width] of a model with them): one chunk of n rows at positions 0..n-1 from a zeroed cache read
    over exactly those n keys; its points [n, ...] fp32."""
    n = x.shape[0]
    captures = run_layer(module, index, x[None], torch.arange(n)[None], kv_read=n,
                         per_layer=None if per_layer is None else per_layer[None])
    return {k: v[0].float().reshape(n, -1) for k, v in captures.items()}


def port_layer_on_cache(backend, index: int, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer `index` on every rank over the cache as loaded (a snapshot's recorded rows): x [n, hidden]
    fed as the first n of the call's `positions` [1, bucket] (the rest padding); its points [n, ...] fp32."""
    n = x.shape[0]

    def step(rank):
        module = backend.ranks[rank]
        rows = torch.zeros(1, positions.shape[1], x.shape[1], dtype=module.dtype)
        rows[0, :n] = x.to(module.dtype)
        return {k: v[0, :n].float() for k, v in run_layer(module, index, rows, positions, fresh=False).items()}

    return backend.on_ranks(step)[0]


def layer_routes(spec, captures: dict, index: int):
    """The experts transformers' layer `index` alone follows: the ones the port's layer chose in
    `captures` (reference.forcing.follow_routes); None for a layer without experts."""
    if f"layers.{index}.expert_weights" not in captures:
        return None
    return follow_routes(captures, spec.moe.top_k).routes[index]
