"""Emitting a standalone repro of the first failing layer (`bisect --emit-repro DIR`): repro.py
(fixtures/repro/repro.py, a script of its own: it imports torch and safetensors only, and
torch-neuronx when asked), repro.safetensors (the
layer's weights, the stage reference's input and outputs for the prompt's rows up to the end of
the failing call, the envelope, the judge's numbers in its metadata) and port_layer.pt (the
port's own layer, at TP 1, traced by torch.jit: it loads with torch alone). Small: one layer at
the prompt's shapes. Written atomically, its size stated first."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from harness.base.atomic import atomic_directory
from harness.base.errors import OptionError
from harness.base.points import layer_points
from harness.judge.compare import JUDGES
from harness.snapshot.record import input_point

FILES = ("repro.py", "repro.safetensors", "port_layer.pt")


class _LayerHost(nn.Module):
    """The port decoder's own run_layers over one layer (its masks, rope and cache writes), the
    other layers' slots holding the same layer: what gets traced."""

    def __init__(self, decoder_cls, spec, layer: nn.Module, index: int, parts: list[str]):
        super().__init__()
        self.spec, self.index, self.parts = spec, index, parts
        self.layers = nn.ModuleList([layer] * (index + 1))  # indexable by the layer's own index
        self._run = decoder_cls.run_layers
        self.layer_input = decoder_cls.__dict__.get("layer_input", None)
        if isinstance(self.layer_input, staticmethod):
            self.layer_input = self.layer_input.__func__

    def forward(self, x, positions, per_layer_input=None):
        if per_layer_input is not None:  # the family decoder picks layer `index`'s slice of these
            self._per_layer_inputs = per_layer_input.unsqueeze(2).expand(-1, -1, self.index + 1, -1)
        captures: dict = {}
        self._run(self, x, positions, self.index, self.index + 1, captures=captures)
        return tuple(captures[f"layers.{self.index}.{p}"].float() for p in self.parts)


def port_layer(checkpoint, settings, index: int, rows: int, parts: list[str]) -> nn.Module:
    """The port's layer `index` at TP 1 in the run's dtype, hosted by its decoder's run_layers."""
    from harness.port.blocks import FamilyRankDecoder
    from harness.port.kv_cache import make_cache
    from harness.port.model import RankDecoder, RankLinears
    from harness.port.sharding import plan_model, shard_layer

    spec, dtype = checkpoint.spec, settings.torch_dtype
    decoder_cls = FamilyRankDecoder if spec.is_family else RankDecoder
    plan = plan_model(spec, 1)[index]
    layer = decoder_cls.layer_class(spec, spec.layers[index], plan, RankLinears(), max_len=rows, dtype=dtype)
    layer.self_attn.cache = make_cache(settings.sliding_cache, spec.layers[index], plan.kv_heads_per_rank, rows, dtype)
    layer.load_state_dict(shard_layer(checkpoint.layer_weights(index, dtype), plan, 0), strict=True)
    layer.self_attn.cache.read_len = rows  # a Python int: a traced shape would turn it into a tensor
    return _LayerHost(decoder_cls, spec, layer.to(dtype).eval(), index, parts)


def _per_layer_input(checkpoint, settings, ids: list[int], index: int) -> torch.Tensor:
    """The port's per-layer input of layer `index` for the rows (host table rows, device projection)."""
    from harness.port.blocks import PerLayerInputs
    from harness.port.engine import Engine

    spec, dtype = checkpoint.spec, settings.torch_dtype
    engine = Engine(spec, None, checkpoint.embed_weight(dtype), settings, per_layer_table=checkpoint.per_layer_table(dtype))
    inputs = engine.embed(torch.tensor(ids, dtype=torch.long))
    module = PerLayerInputs(spec).to(dtype)
    module.load_state_dict(checkpoint.device_model_weights(dtype), strict=True)
    with torch.no_grad():
        return module(inputs[..., :spec.hidden_size], inputs[..., spec.hidden_size:])[0, :, index].contiguous()


def layer_config(spec, index: int) -> dict:
    layer = spec.layers[index]
    return {"hidden": spec.hidden_size, "head_dim": layer.head_dim, "k_eq_v": bool(layer.k_eq_v),
            "window": layer.window, "rope_theta": layer.rope_theta, "rotated_freqs": layer.rotated_freqs,
            "eps": spec.rms_norm_eps, "moe": spec.moe is not None, "top_k": spec.moe.top_k if spec.moe else 0,
            "type": layer.type}


def repro_tensors(checkpoint, settings, target, obs) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The repro's tensors (weights, input, reference and envelope rows [0, end of the call)) and
    the points it judges."""
    spec, i = checkpoint.spec, target.layer
    if target.step is not None:
        raise OptionError(f"--emit-repro: the first failing point, {target.point}, is a decode step's; the repro runs "
                          "the layer over the prompt in one prefill pass, where a decode-only fault does not show: "
                          "replay the snapshot instead (--snapshot DIR, `gemma-parity replay DIR`)")
    if spec.layers[i].kv_source is not None:
        raise OptionError(f"--emit-repro: layer {i} reads layer {spec.layers[i].kv_source}'s cache (KV sharing), so "
                          "it cannot run alone; replay the snapshot instead (--snapshot DIR, `gemma-parity replay`)")
    stop = target.start + target.length
    offset = sum(len(r.prompt) for r in obs.ref32[:target.prompt])
    rows = slice(offset, offset + stop)
    points = layer_points(i, spec=spec)
    tensors = {f"w.{k}": v.contiguous() for k, v in checkpoint.layer_weights(i, settings.torch_dtype).items()}
    tensors["input"] = obs.ref[input_point(i)][rows].float().contiguous()
    for name in points:
        tensors[f"ref.{name.rsplit('.', 1)[1]}"] = obs.ref[name][rows].float().contiguous()
        tensors[f"env.{name.rsplit('.', 1)[1]}"] = obs.env[name][rows].float().contiguous()
    if spec.per_layer_input_size:
        prompt = obs.ref32[target.prompt].prompt[:stop]
        tensors["per_layer_input"] = _per_layer_input(checkpoint, settings, prompt, i).float()
    return {k: t.clone().contiguous() for k, t in tensors.items()}, [name.rsplit(".", 1)[1] for name in points]


def emit_repro(result, checkpoint, settings, out_dir, say=print) -> Path:
    """What `bisect --emit-repro DIR` does after its run."""
    import io

    from safetensors.torch import save

    from harness.snapshot.target import choose_target, stage_settings
    from harness.snapshot.write import refuse_existing

    out_dir = Path(out_dir)
    refuse_existing(out_dir, "--emit-repro")
    target = choose_target(result, settings)
    stage = result.fp32 if target.stage == "fp32" and result.fp32 is not None else result
    run = stage_settings(settings, target.stage)
    tensors, parts = repro_tensors(checkpoint, run, target, stage.observation)
    stop = target.start + target.length
    host = port_layer(checkpoint, run, target.layer, stop, parts)
    example = (tensors["input"].to(run.torch_dtype)[None], torch.arange(stop)[None])
    if "per_layer_input" in tensors:
        example += (tensors["per_layer_input"].to(run.torch_dtype)[None],)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the static branches are this call's shapes
        traced = torch.jit.trace(host, example, check_trace=False)
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    judge = JUDGES[target.stage]
    meta = {"config": layer_config(checkpoint.spec, target.layer), "dtype": str(run.torch_dtype).removeprefix("torch."),
            "factor": judge.factor, "floor": judge.floor, "points": parts, "port_outputs": parts,
            "start": target.start, "stop": stop,
            "description": f"layer {target.layer} ({checkpoint.spec.layers[target.layer].type}) of {checkpoint.path} "
                           f"(spec {checkpoint.spec.spec_hash()}), prompt {target.prompt} rows {target.start}..{stop - 1} "
                           f"of the {target.graph_tag} call, {target.stage} stage: {target.point} "
                           f"{target.ratio:.3g}x in the {'failing' if target.failing else 'passing (control)'} run"}
    blob = save(tensors, metadata={"repro": json.dumps(meta)})
    import harness

    script = (harness.FIXTURES_DIR / "repro" / "repro.py").read_text(encoding="utf-8")
    size = len(blob) + buffer.tell() + len(script)
    say(f"repro plan: {out_dir}: {', '.join(FILES)}, {size / 2**20:.2f} MiB (layer {target.layer}, {stop} rows)")
    with atomic_directory(out_dir) as tmp:
        (tmp / "repro.py").write_text(script, encoding="utf-8")
        (tmp / "repro.safetensors").write_bytes(blob)
        (tmp / "port_layer.pt").write_bytes(buffer.getvalue())
    say(f"repro written to {out_dir}: run `python {out_dir / 'repro.py'}` (torch and safetensors only; "
        "--neuron on an inf2 host)")
    return out_dir
