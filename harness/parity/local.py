"""Each layer alone on the reference's input: the port's layer (every rank's shard, real
collectives) and transformers' own layer in fp32 and bf16, fed the golden's input to that layer.

The verdict itself is harness/judge/layers.py's, transformers' layer harness/reference/layers.py's,
the port's layer run by harness/parity/layer_alone.py. This is Polygraphy's `debug reduce` idea
(feed reference intermediates to the piece under test): a layer that is itself wrong is told apart from error accumulated upstream. `check` uses it for
its local verdicts and `bisect` for its capture mode.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from harness.base.points import Point, layer_points, locate, prefill_order
from harness.base.progress import status
from harness.inputs.family import runs_alone
from harness.judge.compare import PointResult, compare_point
from harness.judge.verdicts import LayerResult
from harness.judge.layers import (LayerRuns, LayerVerdict, _shifted_envelope, judge_layer_alone, judge_local_routing,
                                  stack_prompts)
from harness.parity.layer_alone import layer_routes, port_layer_captures
from harness.parity.own_path import router_alone
from harness.reference.layers import ReferenceLayers


def _layer_input_name(index: int) -> str:
    return "embeddings" if index == 0 else f"layers.{index - 1}.output"


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
    routes = [layer_routes(spec, caps, i) for caps in port]
    r32 = [reference.captures(ref_layers[torch.float32], i, x, torch.float32, r) for x, r in zip(inputs, routes)]
    r16 = [reference.captures(ref_layers[torch.bfloat16], i, x, torch.bfloat16, r) for x, r in zip(inputs, routes)]
    # An MoE layer alone routes by its own input's bf16 noise: it is judged against transformers'
    # layer on its routing (fp32 and bf16, as the bf16 stage is), and its choices by the routing band.
    runs = LayerRuns(port, r32 if moe else golden_caps, r32, r16)
    verdict = judge_layer_alone(spec, i, runs, cumulative, device_out)
    if moe:  # the port's choices decided on its own path: transformers' router alone on its router input
        rows = {n: stack_prompts(port, n) for n in (f"layers.{i}.attn_residual", f"layers.{i}.router_logits")}
        judge_local_routing(verdict, spec, runs, router_alone(reference, rows, spec).get(f"layers.{i}.router_logits"))
    lengths = [caps["embeddings"].shape[0] for caps in golden_caps]
    return verdict, first_nonfinite(spec, {n: stack_prompts(port, n) for n in layer_points(i, spec=spec)}, lengths)

def local_verdicts(checkpoint, layer_backend, obs, cumulative: list[LayerResult],
                   progress: bool = False, reference: ReferenceLayers | None = None) -> tuple[list[LayerVerdict], dict | None]:
    """Every layer of the port alone on the reference's (golden's) input to it, judged by the
    policy, next to its cumulative points as the stage judged them. obs: the stage's observation
    (harness.parity.observation.StageObservation: the references it was judged against, the port's captures);
    cumulative: the stage's judged layers (CheckResult.layers), read, never judged again here.
    `reference`: transformers' layers to run (a later stage reads the runs they keep). The verdicts and
    the first non-finite local capture (or None)."""
    spec = checkpoint.spec
    golden_caps = [r.captures for r in obs.ref32]
    judged = {layer.index: layer for layer in cumulative}
    runners = (layer_backend, reference or ReferenceLayers(checkpoint))
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
