"""Recording the snapshotted call: the port built again as the judged stage ran it and driven by
the engine's own decode loop up to the call (harness.snapshot.calls: the target prompt's earlier
prefill chunks and, for a decode step, the teacher-forced steps before it), then the cache rows
the call reads, the call's inputs exactly as the engine passed them to backend.forward and the
port's own outputs of it, beside the stage's references for the same rows and the first failing
layer's weights on every rank.

Tensor names (the snapshot's safetensors file):
  call.inputs_embeds [1, bucket, width], call.positions [1, bucket]   as the engine passed them
  call.seq_ids [1]          only when the engine passed seq_ids
  prior.{j}.inputs_embeds, prior.{j}.positions   the engine's earlier calls of the prompt, in order
  kv.r{rank}.{layer}.k|v   the rows [0, first position of the call) of each cache it reads (a ring:
                            the whole ring)
  port.{point}, ref.{point}, env.{point}   the call's real rows at the layer's points and final_norm
                            (a decode step's named as the check names them: decode.layers.{i}.*), and
                            at the logits when they are the failing point (a head target: the layer
                            is the last one)
  port.input, ref.input     the layer's input rows (the port's own, the stage reference's)
  pooled.{point}            a pooled part's floors (whole, worst row) as the stage judged it
  routes.{layer}            MoE: the experts the call chose per real row at each layer up to the snapshot's
  weights.r{rank}.{name}    the layer's weights as rank `rank` holds them
"""

from __future__ import annotations

import torch

from harness.base.points import layer_points
from harness.port.sharding import plan_model, shard_layer
from harness.snapshot.calls import call_index, record_calls


def judged_points(spec, layer: int, prefix: str = "") -> list[str]:
    """The points a snapshot stores and its replay judges: the layer's, then the final norm (with
    `prefix` "decode.", a decode step's names in the check's observation)."""
    return [prefix + n for n in layer_points(layer, spec=spec) + ["final_norm"]]


def pooled_floors_of(spec, obs, layer: int, prefix: str = "") -> dict[str, tuple[float, float]]:
    """Per pooled part among the layer's points (compare.POOLED_PARTS), the floors the stage's judge
    gave it: compare.pooled_floors over that part at every layer of the observation."""
    from harness.judge.compare import POOLED_PARTS, pooled_floors

    out = {}
    for name in judged_points(spec, layer, prefix):
        part = name.split(".")[-1]
        if part in POOLED_PARTS:
            names = [n for n in obs.ref if n.startswith(prefix + "layers.") and n.endswith("." + part)]
            out[name] = pooled_floors(names, obs.ref, obs.env)
    return out


def input_point(layer: int, prefix: str = "") -> str:
    return prefix + ("embeddings" if layer == 0 else f"layers.{layer - 1}.output")


LOGITS = ("logits", "decode_logits")  # the head's last point, prefill and decode: stored only for a head target


# A layer's points computed before its experts run (its attention and KV, its router's logits): the
# ones a different expert choice at that layer cannot move (a replay's and a repro's rerouting rule).
BEFORE_EXPERTS = ("attn_residual", "router_logits", "k", "v")


def call_name(name: str) -> str:
    """A point's name in the call's own captures (a decode step's are the prefill names)."""
    return "logits" if name in LOGITS else name.removeprefix("decode.")


def call_routes(spec, captures: dict, layer: int, rows: int) -> dict[str, torch.Tensor]:
    """routes.{j}: the experts the call chose at each MoE layer up to `layer`, per real row
    (reference.forcing.chosen_experts), so that a replay elsewhere names where it routes otherwise."""
    from harness.reference.forcing import chosen_experts

    if spec.moe is None:
        return {}
    found = {}
    for j in range(layer + 1):
        weights = captures.get(f"layers.{j}.expert_weights")
        if weights is not None:
            found[f"routes.{j}"] = chosen_experts(weights[0, :rows].float(), spec.moe.top_k)
    return found


def rank_layer_weights(checkpoint, tp: int, layer: int, dtype, quantize: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Layer `layer`'s weights as each of `tp` ranks holds them (harness.port.sharding); with
    `quantize`, the int8 codes and scales the quantized port holds (harness.inputs.quantize)."""
    weights = layer_weights(checkpoint, layer, dtype, quantize)
    plan = plan_model(checkpoint.spec, tp)[layer]
    return [{k: v.contiguous() for k, v in shard_layer(weights, plan, rank).items()} for rank in range(tp)]


def layer_weights(checkpoint, layer: int, dtype, quantize: str | None = None) -> dict[str, torch.Tensor]:
    """Layer `layer`'s whole weights as the port loads them: quantized from the stored weights with
    `quantize` (never from the quantized model's dequantized copy), else in `dtype`."""
    from harness.inputs.quantize import port_layer_weights, scheme_of

    if quantize is None:
        return checkpoint.layer_weights(layer, dtype)
    return port_layer_weights(checkpoint, layer, scheme_of(quantize), dtype)


def owned_caches(spec) -> list[int]:
    """Layers holding a cache of their own (a KV-shared layer reads its source's)."""
    return [layer.index for layer in spec.layers if layer.kv_source is None]


def _kv_state(spec, rings: dict):
    """A reader of the cache rows a call reads, per rank and layer, as the port stores them: the
    rows [0, its first position) of a linear cache (the position the engine passed, so a host-side
    offset is recorded as the engine made it), a ring whole."""

    def read(backend, call) -> dict[str, torch.Tensor]:
        start, out = call.first_position, {}
        if start <= 0:
            return out
        for rank in range(backend.tp):
            for layer in owned_caches(spec):
                k, v = backend.kv_cache(layer, rank)
                rows = slice(None) if layer in rings else slice(0, start)
                out[f"kv.r{rank}.{layer}.k"] = k[:, :, rows].contiguous().clone()
                out[f"kv.r{rank}.{layer}.v"] = v[:, :, rows].contiguous().clone()
        return out

    return read


def stage_rows(obs, name: str, target) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage's fp32 reference and envelope rows of the call at a point (stacked over prompts;
    a decode point's rows are every prompt's teacher-forced steps after the first)."""
    rows = stage_slice(obs, target)
    return obs.ref[name][rows].float().contiguous(), obs.env[name][rows].float().contiguous()


def stage_slice(obs, target) -> slice:
    """The call's rows among a point's rows stacked over prompts (stage_rows)."""
    if target.step is not None:
        offset = sum(max(len(r.generated) - 1, 0) for r in obs.ref32[:target.prompt]) + target.step
    else:
        offset = sum(len(r.prompt) for r in obs.ref32[:target.prompt]) + target.start
    return slice(offset, offset + target.length)


def record_call(checkpoint, settings, target, observation) -> dict[str, torch.Tensor]:
    """Every tensor of the snapshot (module docstring), the port run once more for the prompt."""
    from harness.parity.observe import build_port
    from harness.port.sharding import ring_windows

    spec, i, prefix = checkpoint.spec, target.layer, target.prefix
    engine = build_port(checkpoint, settings)
    ref = observation.ref32[target.prompt]
    ids = engine.validate_ids(ref.prompt)
    wanted = call_index(ids.numel(), settings, target.step, target.start)
    rings = ring_windows(spec, settings.sliding_cache, settings.kv_len)
    recording = record_calls(engine, ids, ref.generated, wanted, _kv_state(spec, rings))
    call, captures = recording.call, recording.captures
    tensors = dict(recording.kv)
    tensors["call.inputs_embeds"], tensors["call.positions"] = call.inputs_embeds, call.positions
    if call.seq_ids is not None:
        tensors["call.seq_ids"] = call.seq_ids.contiguous()
    for j, prior in enumerate(recording.calls[:-1]):  # what builds the cache on a backend it cannot be loaded into
        tensors[f"prior.{j}.inputs_embeds"], tensors[f"prior.{j}.positions"] = prior.inputs_embeds, prior.positions
    rows = slice(0, target.length)
    logits = [target.point] if target.point in LOGITS else []  # vocabulary-wide rows: only when they failed
    for name in judged_points(spec, i, prefix) + logits:
        tensors[f"port.{name}"] = captures[call_name(name)][0, rows].float().contiguous()
        tensors[f"ref.{name}"], tensors[f"env.{name}"] = stage_rows(observation, name, target)
    for name, floors in pooled_floors_of(spec, observation, i, prefix).items():
        tensors[f"pooled.{name}"] = torch.tensor(floors, dtype=torch.float64)  # the judge's floors (replay's too)
    tensors.update(call_routes(spec, captures, i, target.length))
    tensors["port.input"] = captures[input_point(i)][0, rows].float().contiguous()
    tensors["ref.input"] = stage_rows(observation, input_point(i, prefix), target)[0]
    for rank, weights in enumerate(rank_layer_weights(checkpoint, settings.tp, i, settings.torch_dtype,
                                                              settings.quantize)):
        tensors.update({f"weights.r{rank}.{name}": w for name, w in weights.items()})
    # each its own memory: safetensors refuses views of one tensor (a replicated head, fp32 embeddings)
    return {name: t.detach().clone().contiguous() for name, t in tensors.items()}
