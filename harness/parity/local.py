"""Each layer alone on the reference's input: the port's layer (every rank's shard, real
collectives) and transformers' own layer in fp32 and bf16, fed the golden's input to that layer.

This is Polygraphy's `debug reduce` idea (feed reference intermediates to the piece under test):
a layer that is itself wrong is told apart from error accumulated upstream. `check` uses it for
its local verdicts and `bisect` for its capture mode.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch

from harness.base.points import Point, first_component, layer_points, locate, prefill_order
from harness.base.progress import status
from harness.inputs.family import runs_alone
from harness.judge.compare import ENVELOPE_FACTOR, LayerResult, PointResult, compare_point, rel_l2
from harness.judge.routing import RouterDecisions, judge_decisions
from harness.port import engine as port_engine
from harness.reference.forcing import follow_routes


def _finite_or_none(value):
    """JSON has no Infinity or NaN: a non-finite number is written as null (with `finite` beside it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def tensor_stats(t: torch.Tensor | None) -> dict | None:
    """Polygraphy-style summary of one side's values."""
    if t is None:
        return None
    t = t.double()
    finite = bool(torch.isfinite(t).all())
    return {"mean": float(t.mean()), "std": float(t.std()) if t.numel() > 1 else 0.0,
            "min": float(t.min()), "max": float(t.max()), "finite": finite}


def stack_prompts(runs: list[dict], name: str) -> torch.Tensor:
    """One capture point of every prompt, stacked along the position rows."""
    return torch.cat([r[name] for r in runs], dim=0)


def _layer_input_name(index: int) -> str:
    return "embeddings" if index == 0 else f"layers.{index - 1}.output"


@dataclass
class LayerVerdict:
    """One layer: cumulative points (the port's own run) and local points (the layer alone on the
    golden's input). Truncate mode fills only `cumulative`, with the points its builds read out
    (the output, and the attention residual of the first failing prefix)."""

    index: int
    type: str
    cumulative: list[PointResult]
    local: list[PointResult] = field(default_factory=list)
    # How far transformers' fp32 layer on this checkpoint is from the golden at this layer's output:
    # nonzero when the weights changed since the golden was written.
    checkpoint_drift_rel_l2: float | None = None
    # The port's local run judged against transformers on *this* checkpoint: passes when the port
    # computes today's weights right, so a local failure against the golden is a weight change.
    port_matches_checkpoint: bool | None = None
    stats: dict = field(default_factory=dict)
    routing: object = None  # an MoE layer alone: its router choices judged (harness.judge.routing)

    @property
    def judged(self) -> list[PointResult]:
        return self.local or self.cumulative

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.judged)

    @property
    def cumulative_passed(self) -> bool:
        return all(p.passed for p in self.cumulative)

    @property
    def component(self) -> str | None:
        """attention when the attention residual breaks the policy; mlp when only the MLP residual
        or the scaled output does (the attention half was fine on the same input)."""
        return first_component(self.judged)

    @property
    def finite(self) -> bool:
        return all(p.finite for p in self.cumulative + self.local)

    def to_json(self) -> dict:
        cum, loc = self.cumulative[-1], (self.local[-1] if self.local else None)
        out = {
            "index": self.index, "type": self.type,
            "cumulative_rel_l2": cum.rel_l2, "envelope_rel_l2": cum.envelope_rel_l2,
            "cumulative_ratio": max(p.required_factor for p in self.cumulative),
            "cumulative_pass": self.cumulative_passed,
            "local_rel_l2": loc.rel_l2 if loc else None,
            "local_envelope_rel_l2": loc.envelope_rel_l2 if loc else None,
            "local_ratio": max(p.required_factor for p in self.local) if self.local else None,
            "required_factor": max(p.required_factor for p in self.judged),
            "tolerance_factor": ENVELOPE_FACTOR,
            "pass": self.passed, "finite": self.finite, "component": self.component,
            "checkpoint_drift_rel_l2": self.checkpoint_drift_rel_l2,
            "port_matches_checkpoint": self.port_matches_checkpoint,
            "stats": self.stats,
            "cumulative_points": [asdict(p) for p in self.cumulative],
            "local_points": [asdict(p) for p in self.local],
        }
        return _finite_or_none(out)


# ---- the port's layers alone on the golden's inputs -------------------------------------------

def port_layer_captures(backend, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer `index` of the port (every rank's shard, real all-reduce) alone on x [n, hidden]
    from a reset KV cache: its three capture points, [n, hidden] fp32. It runs through the
    decoder's own `run_layers` (the masks, rope and cache writes the whole-model forward uses), in
    the engine's prefill chunks and positions (a backend built with buckets), so a wiring error in
    the decoder's forward or in chunked prefill shows in the layer's local verdict too."""
    n = x.shape[0]
    buckets = getattr(backend, "buckets", None)
    chunks = port_engine.chunk_plan(n, buckets, backend.max_len) if buckets else [(0, n, n)]

    def step(rank):
        module = backend.ranks[rank]
        module.reset_cache()
        module.set_seq_ids(None)  # one sequence in slot 0: not the slots the last batched call named
        captures: dict[str, list[torch.Tensor]] = {}
        for start, length, bucket in chunks:
            rows = torch.zeros(bucket, x.shape[1], dtype=module.dtype)
            rows[:length] = x[start:start + length].to(module.dtype)
            chunk: dict[str, torch.Tensor] = {}
            module.run_layers(rows[None], port_engine.chunk_positions(start, length, bucket), index, index + 1, chunk)
            for k, v in chunk.items():
                captures.setdefault(k, []).append(v[0, :length].float())
        return {k: torch.cat(v) for k, v in captures.items()}

    return backend.on_ranks(step)[0]


class ReferenceLayers:
    """transformers' own decoder layer on this checkpoint's weights, fp32 and bf16, one at a time:
    the local envelope (bf16 vs fp32 on the same input) and the checkpoint's drift from the golden."""

    def __init__(self, checkpoint):
        from transformers import AutoConfig

        from harness.reference.run import hf_decoder_parts

        # modeling_gemma4's classes for the family, the unified 12B's otherwise
        self.hf, self.checkpoint, self.spec = hf_decoder_parts(checkpoint.spec), checkpoint, checkpoint.spec
        self.config = AutoConfig.from_pretrained(checkpoint.path).get_text_config()
        self.config._attn_implementation = "eager"  # as the port and the reference run
        self.config._experts_implementation = "eager"
        self.rotary = self.hf.rotary(self.config)

    def layer(self, index: int, dtype: torch.dtype):
        with torch.device("meta"):
            layer = self.hf.layer(self.config, index)
        layer.load_state_dict(self.checkpoint.layer_weights(index, dtype), assign=True, strict=True)
        return layer.eval()

    def final_norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        norm = self.hf.norm(self.spec.hidden_size, eps=self.spec.rms_norm_eps)
        norm.weight.data = self.checkpoint.final_norm_weight(dtype)
        with torch.no_grad():
            return norm(x.to(dtype)).float()

    def captures(self, layer, index: int, x: torch.Tensor, dtype: torch.dtype,
                 routes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The layer's capture points on x [n, hidden]; on an MoE layer with `routes` [n, k], its
        router forced to those experts (harness.reference.run.force_routing)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        from harness.reference.forcing import force_routing

        layer_type = self.spec.layers[index].type
        x = x.to(dtype)[None]
        positions = torch.arange(x.shape[1])[None]
        make_mask = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                         position_ids=positions)
        prefix, found = f"layers.{index}.", {}

        def attn_hook(module, args, out):
            found["attn"] = x + out

        def mlp_hook(module, args, out):
            found["mlp"] = found["attn"] + out

        hooks = [layer.post_attention_layernorm.register_forward_hook(attn_hook),
                 layer.post_feedforward_layernorm.register_forward_hook(mlp_hook)] + _router_hooks(layer, found)
        hooks += force_routing({index: layer}, {index: routes}) if routes is not None else []
        try:
            with torch.no_grad():
                out = layer(x, position_embeddings=self.rotary(x, positions, layer_type), attention_mask=mask,
                            position_ids=positions, shared_kv_states={})  # a "store" layer writes into it
        finally:
            for h in hooks:
                h.remove()
        routed = {prefix + k: found[k] for k in ("router_logits", "expert_weights") if k in found}
        return {prefix + "attn_residual": found["attn"][0].float(), prefix + "mlp_residual": found["mlp"][0].float(),
                prefix + "output": out[0].float(), **routed}


def _router_hooks(layer, found: dict) -> list:
    """An MoE layer's router logits and chosen experts' weights (dense over the experts, as the port
    captures them; layer_points judges them), stored in `found`; none on other layers."""
    router = getattr(layer, "router", None)
    if router is None:
        return []

    def logits_hook(module, args, out):
        found["router_logits"] = out.reshape(-1, out.shape[-1]).float()

    def weights_hook(module, args, out):
        probs, weights, chosen = out
        found["expert_weights"] = torch.zeros(probs.shape, dtype=torch.float32).scatter(
            -1, chosen, weights.float()).reshape(-1, probs.shape[-1])

    return [router.proj.register_forward_hook(logits_hook), router.register_forward_hook(weights_hook)]


class LayerRuns(NamedTuple):
    """One layer's capture points per prompt: the port's layer alone, the golden, and transformers'
    own layer in fp32 and bf16 on the same input."""

    port: list[dict]
    golden: list[dict]
    fp32: list[dict]
    bf16: list[dict]


def judge_layer_alone(spec, index: int, runs: LayerRuns, cumulative: LayerResult,
                      device_out: torch.Tensor) -> LayerVerdict:
    """Judge one layer's local run. The error is the port against the golden; the envelope is the
    bf16-vs-fp32 noise of transformers' layer on the same input, added to the golden's value so
    compare_point applies the same policy (floor, per-position ratio) as everywhere else. Using
    this checkpoint's own bf16 output as the envelope would hide a weight change in the envelope."""
    port, golden, ref32, ref16 = runs
    local, against_checkpoint = [], []
    for name in layer_points(index, spec=spec):
        dev, gold = stack_prompts(port, name), stack_prompts(golden, name)
        r32, r16 = stack_prompts(ref32, name), stack_prompts(ref16, name)
        local.append(compare_point(name, dev, gold, _shifted_envelope(gold, r32, r16)))
        against_checkpoint.append(compare_point(name, dev, r32, r16))
    out = f"layers.{index}.output"
    return LayerVerdict(
        index=index, type=spec.layers[index].type, cumulative=cumulative.points, local=local,
        checkpoint_drift_rel_l2=rel_l2(stack_prompts(ref32, out), stack_prompts(golden, out)),
        port_matches_checkpoint=all(p.passed for p in against_checkpoint),
        stats={"golden": tensor_stats(stack_prompts(golden, out)), "port_local": tensor_stats(stack_prompts(port, out)),
               "port_cumulative": tensor_stats(device_out)},
    )


def _shifted_envelope(golden: torch.Tensor, r32: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """The golden plus the bf16-vs-fp32 noise of transformers on this checkpoint: compare_point
    then judges the port against the golden by the local bf16 noise, with its usual floor and
    per-position ratio. This checkpoint's own bf16 output would carry any weight change into the
    envelope and hide it."""
    return golden + (r16 - r32)


def final_norm_alone(layer_backend, reference: ReferenceLayers, golden_caps: list[dict]) -> PointResult:
    """The port's final norm alone on the golden's last layer output (rank 0's norm: replicated,
    no collective), judged against the golden's final norm by transformers' local bf16 noise."""
    last = f"layers.{reference.spec.num_layers - 1}.output"
    module = layer_backend.ranks[0]
    with torch.no_grad():
        alone = torch.cat([module.norm(caps[last].to(module.dtype)).float() for caps in golden_caps])
    r32 = torch.cat([reference.final_norm(caps[last], torch.float32) for caps in golden_caps])
    r16 = torch.cat([reference.final_norm(caps[last], torch.bfloat16) for caps in golden_caps])
    gold = stack_prompts(golden_caps, "final_norm")
    return compare_point("final_norm", alone, gold, _shifted_envelope(gold, r32, r16))


def first_nonfinite(spec, captures: dict[str, torch.Tensor], prompt_lengths: list[int]) -> dict | None:
    """The first capture point, in execution order, holding NaN or Inf, and at which [prompt,
    position] pairs (the first 16)."""
    for name in prefill_order(spec):
        t = captures.get(name)
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = ~torch.isfinite(t)
            rows = bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist()
            return {"layer": Point.parse(name).layer, "point": name, "nan": bool(torch.isnan(t).any()),
                    "inf": bool(torch.isinf(t).any()),
                    "positions": [list(locate(row, prompt_lengths)) for row in rows[:16]]}
    return None


# Below this width a layer's ops are too small for intra-op threads to repay their synchronization:
# on the tiny model (hidden 64) on a busy 2-core machine, one thread runs the local phase ~10x and
# a bisect ~2x faster (the CPU backend's rank threads already use the cores).
SMALL_HIDDEN = 1024


@contextmanager
def intra_op_threads_for(spec):
    """One intra-op thread for models narrower than SMALL_HIDDEN, restored afterwards."""
    before = torch.get_num_threads()
    if spec.hidden_size < SMALL_HIDDEN:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def local_layer(layer_spec, golden_caps: list[dict], runners: tuple, cumulative: LayerResult,
                device_out: torch.Tensor) -> tuple:
    """One layer alone on the golden's input: the port's ranks and transformers' fp32 and bf16;
    runners = (the CPU backend whose ranks run the port's layer, ReferenceLayers); `cumulative` and
    `device_out`: the stage's judged layer and the port's output of it."""
    layer_backend, reference = runners
    spec, i = reference.spec, layer_spec.index
    inputs = [caps[_layer_input_name(i)] for caps in golden_caps]
    port = [port_layer_captures(layer_backend, i, x) for x in inputs]
    ref_layers = {dt: reference.layer(i, dt) for dt in (torch.float32, torch.bfloat16)}
    moe = f"layers.{i}.expert_weights" in port[0]
    routes = [follow_routes(caps, spec.moe.top_k).routes[i] if moe else None for caps in port]
    r32 = [reference.captures(ref_layers[torch.float32], i, x, torch.float32, r) for x, r in zip(inputs, routes)]
    r16 = [reference.captures(ref_layers[torch.bfloat16], i, x, torch.bfloat16, r) for x, r in zip(inputs, routes)]
    # An MoE layer alone routes by its own input's bf16 noise: it is judged against transformers'
    # layer on its routing (fp32 and bf16, as the bf16 stage is), and its choices by the routing band.
    runs = LayerRuns(port, r32 if moe else golden_caps, r32, r16)
    verdict = judge_layer_alone(spec, i, runs, cumulative, device_out)
    if moe:
        _judge_local_routing(verdict, spec, runs)
    lengths = [caps["embeddings"].shape[0] for caps in golden_caps]
    return verdict, first_nonfinite(spec, {n: stack_prompts(port, n) for n in layer_points(i, spec=spec)}, lengths)


def _judge_local_routing(verdict: LayerVerdict, spec, runs: LayerRuns) -> None:
    """An MoE layer alone: a router choice off the fp32 top-k beyond the routing band fails its
    expert-weights point (harness/judge/routing.py judges it as the bf16 stage does)."""
    i, name = verdict.index, f"layers.{verdict.index}.expert_weights"
    logits = f"layers.{i}.router_logits"
    routing = judge_decisions([RouterDecisions(name, stack_prompts(runs.port, name), stack_prompts(runs.fp32, logits),
                                               stack_prompts(runs.bf16, logits))],
                              spec.moe.top_k, lambda n, row: f"row {row}")
    verdict.routing = routing
    if not routing.passed:  # the port's choice against this checkpoint's own logits: the port's error
        verdict.local = [replace(p, passed=False) if p.name == name else p for p in verdict.local]
        verdict.port_matches_checkpoint = False


def local_verdicts(checkpoint, layer_backend, obs, cumulative: list[LayerResult],
                   progress: bool = False) -> tuple[list[LayerVerdict], dict | None]:
    """Every layer of the port alone on the reference's (golden's) input to it, judged by the
    policy, next to its cumulative points as the stage judged them. obs: the stage's observation
    (harness.parity.observe.StageObservation: the references it was judged against, the port's captures);
    cumulative: the stage's judged layers (CheckResult.layers), read, never judged again here.
    The verdicts and the first non-finite local capture (or None)."""
    spec = checkpoint.spec
    golden_caps = [r.captures for r in obs.ref32]
    judged = {layer.index: layer for layer in cumulative}
    runners = (layer_backend, ReferenceLayers(checkpoint))
    verdicts, local_nonfinite = [], None
    with status("local", progress, total=spec.num_layers) as say, intra_op_threads_for(spec):
        for layer_spec in spec.layers:
            stage_layer = judged[layer_spec.index]
            if not runs_alone(spec, layer_spec.index):  # per-layer input or shared KV: cumulative only
                verdicts.append(LayerVerdict(layer_spec.index, layer_spec.type, stage_layer.points))
                continue
            say(f"layer {layer_spec.index} of 0..{spec.num_layers - 1} ({layer_spec.type}) alone on the "
                "reference's input")
            verdict, nonfinite = local_layer(layer_spec, golden_caps, runners, stage_layer,
                                             obs.dev[f"layers.{layer_spec.index}.output"])
            verdicts.append(verdict)
            local_nonfinite = local_nonfinite or nonfinite
    return verdicts, local_nonfinite
