"""The bit-exact layer stage: every layer of the port that runs alone, in bf16 at TP 1 on CPU, fed
the reference's (golden's) input to it in one chunk of exactly the prompt's rows, against
transformers' own layer in bf16 (and fp32, which way a departure rounds) on the same input.

The local verdicts (harness/parity/local.py) run the port's layers as the engine runs them (its TP,
prefill chunks, cache) and judge them by the bf16 envelope; this stage removes everything that may
legitimately reorder a sum (row-parallel partials rounded before their all-reduce at TP 2, padded
chunks, a cache longer than the prompt) so that what is left is the model's arithmetic, compared bit
for bit (harness/judge/bitwise.py judges it).
"""

from __future__ import annotations

import torch

from harness.base.points import layer_points
from harness.inputs.family import runs_alone
from harness.judge.bitwise import BitwiseStage, point_bits
from harness.reference.forcing import follow_routes
from harness.reference.layers import ReferenceLayers

# Forced on transformers' side, so not the port's arithmetic: the chosen experts' weights (its router
# logits are compared).
NOT_COMPARED = ("expert_weights",)


def tp1_module(checkpoint, rows: int):
    """Rank 0 of a TP 1 bf16 CPU port of `checkpoint` with a linear cache of `rows` slots, built for
    this stage (the engine's own may shard, batch, chunk or ring its cache). Its weights cost a bf16
    copy of the decoder and lm_head while the stage runs."""
    from harness.backends import make_backend
    from harness.base.settings import RunSettings

    settings = RunSettings(backend="cpu", tp=1, dtype="bfloat16", buckets=(rows,), kv_len=rows)
    return make_backend(checkpoint, settings).ranks[0]  # the ranks only: no host embedding table


def port_layer_exact(module, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer `index` of the port alone on x [n, hidden]: one chunk of n rows at positions 0..n-1, the
    cache read over exactly those n keys; its capture points [n, ...] fp32."""
    n = x.shape[0]
    module.reset_cache()
    module.set_seq_ids(None)
    module.set_kv_read(n)
    captures: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        module.run_layers(x.to(module.dtype)[None], torch.arange(n)[None], index, index + 1, captures)
    module.set_kv_read(None)
    return {k: v[0].float().reshape(n, -1) for k, v in captures.items()}


def bitwise_layers(checkpoint, engine, golden_caps: list[dict]) -> BitwiseStage:
    """The stage over every layer that runs alone; golden_caps: the fp32 reference's captures per
    prompt (the layers' inputs)."""
    spec, settings = checkpoint.spec, engine.settings
    stage = BitwiseStage(skipped=[layer.index for layer in spec.layers if not runs_alone(spec, layer.index)])
    alone = [layer.index for layer in spec.layers if runs_alone(spec, layer.index)]
    if settings.dtype != "bfloat16" or getattr(settings, "quantize", None) is not None:
        stage.notes.append(f"not judged: the port runs {settings.quantize or settings.dtype}, not the model's bf16")
        return stage
    if not alone:
        stage.notes.append("no layer of this model runs alone (per-layer inputs): the stage judged nothing")
        return stage
    module = tp1_module(checkpoint, max(c["embeddings"].shape[0] for c in golden_caps))
    reference = ReferenceLayers(checkpoint)
    for i in alone:
        layers = {dt: reference.layer(i, dt) for dt in (torch.bfloat16, torch.float32)}
        runs = []
        for caps in golden_caps:
            x = caps["embeddings" if i == 0 else f"layers.{i - 1}.output"]
            port = port_layer_exact(module, i, x)
            routes = follow_routes(port, spec.moe.top_k).routes[i] if f"layers.{i}.expert_weights" in port else None
            runs.append((port, *(reference.captures(layers[dt], i, x, dt, routes) for dt in layers)))
        for name in layer_points(i, spec=spec):
            if name.split(".")[-1] in NOT_COMPARED or name not in runs[0][1]:
                continue
            port, r16, r32 = (torch.cat([run[k][name] for run in runs]) for k in range(3))
            stage.points.append(point_bits(name, port, r16, r32))
        del layers
    return stage
