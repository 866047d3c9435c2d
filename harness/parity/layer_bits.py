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

from contextlib import contextmanager

import torch

from harness.base.points import layer_points
from harness.judge.bitwise import BitwiseStage, point_bits
from harness.judge.stage_result import Stage
from harness.parity.layer_alone import layer_routes, port_layer_exact
from harness.parity.port_failure import PortFailure, port_call
from harness.reference.layers import ReferenceLayers

# Forced on transformers' side, so not the port's arithmetic: the chosen experts' weights (its router
# logits are compared).
NOT_COMPARED = ("expert_weights",)


class LayerAtATime:
    """The port's decoder at TP 1 in bf16 (its own module code: masks, rope, caches as the
    whole-model forward runs them) built on the meta device, one layer's weights and cache
    materialised while it runs: a bf16 copy of one layer at a time, never the decoder's nor lm_head's."""

    def __init__(self, checkpoint, rows: int):
        from harness.port.blocks import rank_decoder
        from harness.port.sharding import plan_model

        self.checkpoint, self.plans = checkpoint, plan_model(checkpoint.spec, 1)
        with torch.device("meta"):  # a linear cache of exactly `rows` slots, one sequence
            self.module = rank_decoder(checkpoint.spec, tp=1, max_len=rows, dtype=torch.bfloat16)

    @contextmanager
    def layer(self, index: int):
        """The module with layer `index` materialised (its weights loaded; port_layer_exact zeroes its
        cache), freed after; index None: the per-layer inputs' projection (E2B, E4B)."""
        from harness.port.sharding import shard_layer

        block = self.module.layers[index] if index is not None else self.module.per_layer
        block.to_empty(device="cpu")
        weights = (self.checkpoint.device_model_weights(torch.bfloat16) if index is None else
                   shard_layer(self.checkpoint.layer_weights(index, torch.bfloat16), self.plans[index], 0))
        block.load_state_dict(weights, strict=True)
        block.eval()
        try:
            yield self.module
        finally:
            block.to("meta")


def per_layer_inputs(checkpoint, port_layers: LayerAtATime, references) -> list[torch.Tensor | None] | None:
    """Each prompt's per-layer inputs [n, layers, width] in bf16 (None on a model without them; None
    for all when the golden's rows are not the prompts' tokens), fed
    to both sides alike: transformers' scaled per-layer rows of the prompt's tokens
    (host_rows.reference_rows) combined with the golden's word embeddings by the port's projection."""
    from harness.parity.host_rows import reference_rows

    if not checkpoint.spec.per_layer_input_size:
        return [None] * len(references)
    out = []
    with port_layers.layer(None) as module, torch.no_grad():
        for ref in references:
            ids = torch.tensor(ref.prompt, dtype=torch.long)
            if ids.numel() != ref.captures["embeddings"].shape[0]:
                return None  # the golden's rows are not the prompt's prefill: no per-layer rows to feed
            rows = reference_rows(checkpoint, ids, torch.bfloat16)
            out.append(module.per_layer(ref.captures["embeddings"].to(torch.bfloat16)[None], rows[None])[0])
    return out


def bitwise_layers(checkpoint, engine, references, reference: ReferenceLayers | None = None) -> BitwiseStage:
    """The stage over every layer that runs alone (its own KV cache: a KV-shared layer reads another's);
    references: the fp32 reference's results per prompt (their captures hold the layers' inputs);
    `reference`: transformers' layers as the local verdicts ran them (their kept runs on the same
    inputs are not run again), released here."""
    spec, settings = checkpoint.spec, engine.settings
    alone = [layer.index for layer in spec.layers if layer.kv_source is None]
    stage = BitwiseStage(skipped=[layer.index for layer in spec.layers if layer.index not in alone])
    if settings.dtype != "bfloat16" or getattr(settings, "quantize", None) is not None:
        stage.notes.append(f"not judged: the port runs {settings.quantize or settings.dtype}, not the model's bf16")
        return stage
    golden_caps = [r.captures for r in references]
    port_layers = LayerAtATime(checkpoint, max(c["embeddings"].shape[0] for c in golden_caps))
    ple = per_layer_inputs(checkpoint, port_layers, references)
    if ple is None:
        stage.notes.append("not judged: the golden's embeddings rows are not its prompts' tokens (no per-layer rows)")
        return stage
    reference = reference or ReferenceLayers(checkpoint)
    for i in alone:
        layers = {dt: reference.layer(i, dt) for dt in (torch.bfloat16, torch.float32)}
        inputs = [caps["embeddings" if i == 0 else f"layers.{i - 1}.output"] for caps in golden_caps]
        own = [p[:, i] if p is not None else None for p in ple]
        with port_layers.layer(i) as module:
            ports = [port_layer_exact(module, i, x, p) for x, p in zip(inputs, ple)]
        runs = []
        for x, port, p in zip(inputs, ports, own):
            routes = layer_routes(spec, port, i)
            runs.append((port, *(reference.captures(layers[dt], i, x, dt, routes=routes, per_layer_input=p)
                                 for dt in layers)))
        for name in layer_points(i, spec=spec):
            if name.split(".")[-1] in NOT_COMPARED or name not in runs[0][1]:
                continue
            port, r16, r32 = (torch.cat([run[k][name] for run in runs]) for k in range(3))
            stage.points.append(point_bits(name, port, r16, r32))
        del layers
    return stage


def bitwise_layers_stage() -> Stage:
    """The bit-exact layers as a stage of the parity run, where the local verdicts ran (the backend's
    ranks on CPU): it reads the bf16 stage's observation (the fp32 references' layer inputs) and the
    parity build's settings; an exception inside the port's layers alone is the stage's failure."""
    def run(checkpoint, engine, bf16):
        if bf16.port_error or bf16.local is None:  # the local verdicts did not run (not the CPU's ranks)
            return None
        try:
            return port_call("bit-exact layers", lambda: bitwise_layers(checkpoint, engine, bf16.observation.ref32,
                                                                        bf16.reference_layers))
        except PortFailure as failure:
            return BitwiseStage(error=failure.describe())
        finally:
            if bf16.reference_layers is not None:
                bf16.reference_layers.release()  # no later stage reads the local verdicts' runs
    return Stage("bitwise_layers", run, reads=("checkpoint", "engine"), after=("bf16",))
