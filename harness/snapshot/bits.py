"""A bit-exact snapshot: the check's first failure in the bit-exact layer stage (harness/parity/layer_bits.py,
judged by harness/judge/bitwise.py), where no layer point of the fp32 or bf16 stage fails at or before
that layer (a precision-ordering fault: every point within the envelope, but the port's layer alone
rounds otherwise than transformers' bf16 layer on the same input).

What is recorded (beside the layer's weights, weights.r0.*, as a TP 1 snapshot holds them):
  bits.input [n, hidden] bf16        the golden's input rows to the layer, as the port was fed them
  bits.per_layer_input [n, P] bf16   the layer's per-layer input (the family's PLE models), fed to both sides
  bits.ref16.{point} bf16, bits.ref32.{point} fp32   transformers' layer in bf16 and fp32 on that input
for the first prompt where the failing point departs (n: its rows, one chunk). The replay runs the
port's layer the way the stage did (layer_alone.port_layer_exact through LayerAtATime, TP 1, bf16, on
cpu) and judges it as the stage does (point_bits, BitwiseStage's gate and its DEPARTURE_LIMIT).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harness.base.errors import OptionError
from harness.base.points import layer_points
from harness.judge.bitwise import DEPARTURE_LIMIT, BitwiseStage, point_bits
from harness.parity.layer_alone import layer_routes, port_layer_exact
from harness.parity.layer_bits import NOT_COMPARED, LayerAtATime, per_layer_inputs
from harness.snapshot.record import input_point, rank_layer_weights

STAGE = BitwiseStage.stage


def bits_settings(settings):
    """The settings the stage's layers ran with: cpu, TP 1, bf16, linear caches, one sequence."""
    return settings.but(backend="cpu", tp=1, dtype="bfloat16", sliding_cache="linear", batch=1, backend_options={})


def compared_points(spec, layer: int, names) -> list[str]:
    """The layer's points the stage compares (those transformers' layer captures, less NOT_COMPARED)."""
    return [n for n in layer_points(layer, spec=spec) if n.split(".")[-1] not in NOT_COMPARED and n in names]


def port_layer(checkpoint, layer: int, x: torch.Tensor, per_layer: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The port's layer alone on x [n, hidden] as the stage runs it (`per_layer` [n, P]: its per-layer
    input, in the layer's slot of the decoder's per-layer inputs)."""
    port_layers = LayerAtATime(checkpoint, x.shape[0])
    full = None
    if per_layer is not None:
        full = torch.zeros(x.shape[0], checkpoint.spec.num_layers, per_layer.shape[-1], dtype=torch.bfloat16)
        full[:, layer] = per_layer.to(torch.bfloat16)
    with port_layers.layer(layer) as module:
        return port_layer_exact(module, layer, x, full)


def record_bits(checkpoint, target, observation, prompt: int | None = None):
    """(the target with its prompt, rows and departing share, the snapshot's tensors): the first
    prompt where the target's point departs (`prompt`: that prompt, departing or not: a control),
    run again on both sides as the stage ran it."""
    from harness.reference.layers import ReferenceLayers

    spec, i, refs = checkpoint.spec, target.layer, observation.ref32
    rows = max(r.captures["embeddings"].shape[0] for r in refs)
    ple = per_layer_inputs(checkpoint, LayerAtATime(checkpoint, rows), refs)
    if ple is None:
        raise OptionError("--snapshot: the golden's rows are not its prompts' tokens, so the bit-exact layers were "
                          "not judged; nothing to snapshot")
    reference = ReferenceLayers(checkpoint)
    layers = {dt: reference.layer(i, dt) for dt in (torch.bfloat16, torch.float32)}
    for index, ref in enumerate(refs):
        if prompt is not None and index != prompt:
            continue
        golden = ref.captures[input_point(i)]  # fp32: the stage feeds it so (each side casts it to its dtype)
        x = golden.to(torch.bfloat16)
        own = ple[index][:, i] if ple[index] is not None else None
        port = port_layer(checkpoint, i, x, own)
        routes = layer_routes(spec, port, i)
        r16, r32 = (reference.captures(layers[dt], i, golden, dt, routes=routes, per_layer_input=own)
                    for dt in (torch.bfloat16, torch.float32))
        found = point_bits(target.point, port[target.point], r16[target.point], r32[target.point])
        if found.departs or prompt is not None:
            break
    else:
        raise OptionError(f"--snapshot: {target.point} departs over all prompts together but in none alone; "
                          "snapshot the check's verdict instead")
    n = x.shape[0]
    tensors = {"bits.input": x.contiguous()}
    if own is not None:
        tensors["bits.per_layer_input"] = own.to(torch.bfloat16).contiguous()
    for name in compared_points(spec, i, r16):
        tensors[f"bits.ref16.{name}"] = r16[name].reshape(n, -1).to(torch.bfloat16)
        tensors[f"bits.ref32.{name}"] = r32[name].reshape(n, -1).float()
    tensors.update({f"weights.r0.{k}": w for k, w in rank_layer_weights(checkpoint, 1, i, torch.bfloat16)[0].items()})
    target = replace(target, prompt=index, length=n, bucket=n, ratio=found.fraction)
    return target, {name: t.detach().clone().contiguous() for name, t in tensors.items()}


def bits_manifest() -> dict:
    """What a bit-exact snapshot's manifest says of its judge (informative: the replay judges by
    harness/judge/bitwise.py as it is)."""
    return {"departure_limit": DEPARTURE_LIMIT}


class BitsReplay:
    """One bit-exact replay (cpu, TP 1, the layer alone), judged as the stage judges."""

    def __init__(self, points: list):
        self.backend, self.tp, self.mode, self.points = "cpu", 1, "layer alone, bit-exact", points
        self.rerouted = ()  # the layer alone follows the recorded run's routes (reference.forcing)
        self.stage = BitwiseStage(points=points).seal()

    @property
    def reproduces(self) -> bool:
        return not self.stage.passed

    def describe(self) -> str:
        head = f"{self.backend} (TP {self.tp}, {self.mode}): "
        failures = self.stage.failures()
        if failures:
            return head + f"REPRODUCES: {failures[0]['point']}: {failures[0]['detail']}"
        worst = max(self.points, key=lambda p: p.fraction)
        return head + (f"agrees: no point departs over {DEPARTURE_LIMIT:.1%} of its elements (largest {worst.name} "
                       f"{worst.fraction:.2%})")


def check_bits_mode(backend_name: str, tp: int) -> None:
    if backend_name != "cpu" or tp != 1:
        raise OptionError(f"--backend {backend_name} --tp {tp}: a bit-exact snapshot replays the layer alone as the "
                          "bitwise_layers stage ran it, on cpu at TP 1 in bf16; pass --backend cpu (and --tp 1)")


def replay_bits(snap, checkpoint) -> BitsReplay:
    """The port's layer alone on the recorded input, every stored point judged bit for bit."""
    t, i = snap.tensors, snap.layer
    port = port_layer(checkpoint, i, t["bits.input"], t.get("bits.per_layer_input"))
    names = [n.removeprefix("bits.ref16.") for n in t if n.startswith("bits.ref16.")]
    names = compared_points(checkpoint.spec, i, names)
    return BitsReplay([point_bits(n, port[n], t[f"bits.ref16.{n}"].float(), t[f"bits.ref32.{n}"]) for n in names])
