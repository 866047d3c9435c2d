"""Emitting a standalone repro of the first failing layer (`bisect --emit-repro DIR`): repro.py
(fixtures/repro/repro.py, a script of its own: it imports torch and safetensors only, and
torch-neuronx when asked), repro.safetensors and port_rank{r}.pt (the port's own layer per rank of
the run's TP plan, traced once per device call: harness.snapshot.traced_layer).

The calls are the engine's own (harness.snapshot.calls): every call of the target prompt up to the
failing one (its earlier prefill chunks, and for a decode step the prefill and the teacher-forced
steps before it), each with the positions, padding and KV bucket the engine and backend gave it,
fed the stage reference's input rows of the call. The script runs them in order on every rank,
carrying each rank's KV cache from call to call and summing the ranks' partials where the port
all-reduces; a plain reading runs the same rows in one pass at their true positions. A KV-shared
layer (the family's E-series) brings its source layer along: the source writes the cache the shared
layer reads. Small: one layer (two when shared) at the prompt's shapes, per rank; written
atomically, its size stated first."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from harness.base.atomic import atomic_directory
from harness.base.points import layer_points
from harness.judge.compare import JUDGES, POOLED_PARTS, ROW_NORM_FLOOR
from harness.snapshot.record import BEFORE_EXPERTS, LOGITS, input_point, pooled_floors_of, stage_rows
from harness.snapshot.write import settings_record, user_checkpoint

FILES = ("repro.py", "repro.safetensors", "port_rank{rank}.pt")


def layer_config(spec, index: int) -> dict:
    layer = spec.layers[index]
    return {"hidden": spec.hidden_size, "head_dim": layer.head_dim, "k_eq_v": bool(layer.k_eq_v),
            "window": layer.window, "rope_theta": layer.rope_theta, "rotated_freqs": layer.rotated_freqs,
            "eps": spec.rms_norm_eps, "moe": spec.moe is not None, "top_k": spec.moe.top_k if spec.moe else 0,
            "type": layer.type}


def _per_layer_inputs(checkpoint, settings, inputs_embeds: torch.Tensor) -> torch.Tensor:
    """[1, s, layers, P]: the per-layer inputs the device computes from a call's inputs_embeds."""
    from harness.port.blocks import PerLayerInputs

    spec, dtype = checkpoint.spec, settings.torch_dtype
    module = PerLayerInputs(spec).to(dtype)
    module.load_state_dict(checkpoint.device_model_weights(dtype), strict=True)
    with torch.no_grad():
        return module(inputs_embeds[..., :spec.hidden_size].to(dtype), inputs_embeds[..., spec.hidden_size:].to(dtype))


def _reference_rows(obs, target, layer: int, *, n_prefill: int, j: int, row: int, rows: int) -> torch.Tensor:
    """The stage reference's input to `layer` at the real rows of call j of the target prompt."""
    if j < n_prefill:
        offset = sum(len(r.prompt) for r in obs.ref32[:target.prompt]) + row
        name = input_point(layer)
    else:
        offset = sum(max(len(r.generated) - 1, 0) for r in obs.ref32[:target.prompt]) + (j - n_prefill)
        name = input_point(layer, "decode.")
    return obs.ref[name][offset:offset + rows].float()


def engine_calls(checkpoint, settings, target, obs):
    """The engine's calls of the target prompt up to the failing one, with the (prefill chunk
    count, call list) (harness.snapshot.calls)."""
    from harness.parity.observe import build_port
    from harness.port.engine import chunk_plan
    from harness.snapshot.calls import call_index, record_calls

    engine = build_port(checkpoint, settings)
    ref = obs.ref32[target.prompt]
    ids = engine.validate_ids(ref.prompt)
    recording = record_calls(engine, ids, ref.generated, call_index(ids.numel(), settings, target.step, target.start))
    return len(chunk_plan(ids.numel(), settings.buckets, settings.kv_len)), recording.calls


def repro_inputs(checkpoint, settings, target, obs) -> tuple[dict, list[dict], list[int]]:
    """The script's tensors, each call's inputs (for tracing) and the hosted layers."""
    from harness.port import graphs

    from harness.snapshot.traced_layer import port_source

    spec, i = checkpoint.spec, target.layer
    source = spec.layers[i].kv_source  # the plain reading's: the model's own
    hosted = [i] if source is None else [port_source(spec, i), i]  # the port's: as its decoder binds it
    n_prefill, calls = engine_calls(checkpoint, settings, target, obs)
    kv_lengths = graphs.kv_buckets(settings.buckets, settings.kv_len)
    tensors, traced, row = {}, [], 0
    plain = {j: [] for j in {i, source} - {None}}
    plain_ple = {j: [] for j in plain}
    for j, call in enumerate(calls):
        rows, bucket = call.real_rows, call.positions.shape[1]
        xs = torch.zeros(len(hosted), 1, bucket, spec.hidden_size)
        for layer in set(hosted) | set(plain):
            x = _reference_rows(obs, target, layer, n_prefill=n_prefill, j=j, row=row, rows=rows)
            if layer in hosted:
                xs[hosted.index(layer), 0, :rows] = x
            if layer in plain:
                plain[layer].append(x)
        ples = torch.zeros(0)
        if spec.per_layer_input_size:
            per_layer = _per_layer_inputs(checkpoint, settings, call.inputs_embeds)
            ples = torch.stack([per_layer[:, :, layer] for layer in hosted]).float()
            for layer in plain:
                plain_ple[layer].append(per_layer[0, :rows, layer].float())
            tensors[f"call{j}.ples"] = ples
        row += rows if j < n_prefill else 0
        tensors[f"call{j}.xs"], tensors[f"call{j}.positions"] = xs, call.positions
        traced.append({"xs": xs.to(settings.torch_dtype), "positions": call.positions,
                       "ples": ples.to(settings.torch_dtype),
                       "read_len": graphs.kv_read_length(call.positions, kv_lengths),
                       "rows": rows})
    tensors["input"] = torch.cat(plain[i])
    if spec.per_layer_input_size:
        tensors["per_layer_input"] = torch.cat(plain_ple[i])
    if source is not None:
        tensors["source_input"] = torch.cat(plain[source])
        tensors.update({f"ws.{k}": v for k, v in checkpoint.layer_weights(source, settings.torch_dtype).items()})
        if spec.per_layer_input_size:
            tensors["source_per_layer_input"] = torch.cat(plain_ple[source])
    tensors.update({f"w.{k}": v for k, v in checkpoint.layer_weights(i, settings.torch_dtype).items()})
    for name in layer_points(i, spec=spec):
        ref, env = stage_rows(obs, target.prefix + name, target)
        part = name.rsplit(".", 1)[1]
        tensors[f"ref.{part}"], tensors[f"env.{part}"] = ref, env
    return tensors, traced, hosted


def emit_repro(result, checkpoint, settings, out_dir, say=print) -> Path:
    """What `bisect --emit-repro DIR` does after its run."""
    from harness.snapshot.target import BITS_STAGE, choose_target, stage_settings
    from harness.snapshot.write import refuse_existing

    refuse_existing(out_dir, "--emit-repro")
    target = choose_target(result, settings)
    if target.host or target.point in LOGITS:  # no layer behind it: the host step's or the head's repro
        from harness.snapshot.host_repro import host_repro_inputs

        tensors, meta = host_repro_inputs(result, checkpoint, stage_settings(settings, target.stage), target)
        return save_repro(out_dir, tensors, meta, [], what=f"the {meta['kind']} step", say=say,
                          script="host_repro.py", how="a plain reading beside the port's recorded output")
    if target.stage == BITS_STAGE:
        return write_bits_repro(checkpoint, settings, target, result.bf16.observation, out_dir, say=say)
    stage = result.judged(target.stage)
    return write_repro(checkpoint, stage_settings(settings, target.stage), target, stage.observation, out_dir, say=say)


def write_repro(checkpoint, run, target, observation, out_dir, say=print) -> Path:
    """The repro of `target`'s call (harness.snapshot.target.Target) from the stage `observation`
    its port ran with settings `run`: planned, then written atomically into `out_dir`."""
    from harness.snapshot.traced_layer import host_cache, rank_hosts, trace_rank

    tensors, calls, hosted = repro_inputs(checkpoint, run, target, observation)
    parts = [name.rsplit(".", 1)[1] for name in layer_points(target.layer, spec=checkpoint.spec)]
    modules, reductions, kv = [], None, []
    hosts = rank_hosts(checkpoint, run, target.layer, parts)
    for host in hosts:
        traced, counts = trace_rank(host, calls)
        modules.append(traced_bytes(traced))
        reductions = counts
        kv.append([list(t.shape) for t in host_cache(host)])
    judge, spec = JUDGES[target.stage], checkpoint.spec
    shared = f", KV-shared: reads layer {spec.layers[target.layer].kv_source} cache" if len(hosted) > 1 else ""
    meta = {"config": layer_config(spec, target.layer), "dtype": str(run.torch_dtype).removeprefix("torch."),
            "source_config": layer_config(spec, spec.layers[target.layer].kv_source) if len(hosted) > 1 else None,
            "factor": judge.factor, "floor": judge.floor, "points": parts,
            "before_experts": [part for part in parts if part in BEFORE_EXPERTS],
            "pooled": {n.rsplit(".", 1)[1]: list(f) for n, f in pooled_floors_of(spec, observation, target.layer,
                                                                                target.prefix).items()},
            "row_floor": {part: 1.0 if part in POOLED_PARTS else ROW_NORM_FLOOR for part in parts},
            "tp": run.tp, "kv_shapes": kv, "settings": settings_record(run),
            "calls": [{"method": f"call{j}", "sums": reductions[j], "rows": c["rows"]} for j, c in enumerate(calls)],
            "target_rows": target.length,
            "description": f"layer {target.layer} ({spec.layers[target.layer].type}"
                           f"{shared}{', ' + run.quantize + ' weights' if run.quantize else ''}) of "
                           f"{user_checkpoint(checkpoint).path} "
                           f"(spec {spec.spec_hash()}) at TP {run.tp}, prompt {target.prompt}: the "
                           f"{target.graph_tag} call (call {len(calls) - 1} of the engine's {len(calls)}), "
                           f"{target.stage} stage: {target.point} {target.ratio:.3g}x in the "
                           f"{'failing' if target.failing else 'passing (control)'} run"}
    if run.demo_fault:  # plainly labelled: the script prints the description first
        from harness.port.demo_fault import banner

        meta["description"] = f"{banner(run.demo_fault)}\n{meta['description']}"
    written = save_repro(out_dir, tensors, meta, modules, what=f"layer {target.layer}, {len(calls)} calls, TP {run.tp}",
                         say=say)
    from harness.snapshot.hlo_bundle import maybe_write, write_layer_bundles

    maybe_write(lambda: write_layer_bundles(checkpoint, run, target, hosts, calls, out_dir=out_dir, say=say), say)
    return written


def save_repro(out_dir, tensors: dict, meta: dict, modules: list[bytes], what: str, say=print,
               how: str = "--neuron on an inf2 host", script: str = "repro.py") -> Path:
    """repro.py, repro.safetensors (`meta` in its metadata) and the traced ranks: planned, then
    written atomically into `out_dir`."""
    from safetensors.torch import save

    import harness

    out_dir = Path(out_dir)
    blob = save({k: t.detach().clone().contiguous() for k, t in tensors.items()}, metadata={"repro": json.dumps(meta)})
    script = (harness.FIXTURES_DIR / "repro" / script).read_text(encoding="utf-8")
    size = len(blob) + sum(map(len, modules)) + len(script)
    say(f"repro plan: {out_dir}: repro.py, repro.safetensors, {len(modules)} x port_rank{{r}}.pt, {size / 2**20:.2f} "
        f"MiB ({what})")
    with atomic_directory(out_dir, final=True) as tmp:  # a signal after its rename: held, the run ends (commit_point)
        (tmp / "repro.py").write_text(script, encoding="utf-8")
        (tmp / "repro.safetensors").write_bytes(blob)
        for rank, module in enumerate(modules):
            (tmp / f"port_rank{rank}.pt").write_bytes(module)
    say(f"repro written to {out_dir}: run `python {out_dir / 'repro.py'}` (torch and safetensors only; {how})")
    return out_dir


def traced_bytes(traced) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    return buffer.getvalue()


def write_bits_repro(checkpoint, settings, target, observation, out_dir, say=print, prompt: int | None = None) -> Path:
    """The repro of a bit-exact target (harness.snapshot.bits): the port's layer alone traced at TP 1
    in bf16 on the one chunk of the prompt's rows (harness.snapshot.traced_layer), the recorded input,
    transformers' bf16 outputs and the stage's departure limit; the script compares bit for bit.
    `prompt`: that prompt's rows (a control), else the first where the target's point departs."""
    from harness.judge.bitwise import DEPARTURE_LIMIT
    from harness.snapshot.bits import bits_settings, record_bits
    from harness.snapshot.traced_layer import host_cache, rank_hosts, trace_rank

    target, recorded = record_bits(checkpoint, target, observation, prompt)
    i, n, spec = target.layer, target.length, checkpoint.spec
    run = bits_settings(settings).but(kv_len=n)  # the stage's cache: exactly the chunk's rows
    names = [k.removeprefix("bits.ref16.") for k in recorded if k.startswith("bits.ref16.")]
    parts = [name.rsplit(".", 1)[1] for name in names]
    ple = recorded.get("bits.per_layer_input")
    ples = torch.zeros(0) if ple is None else ple.float()[None, None]
    call = {"xs": recorded["bits.input"][None, None], "positions": torch.arange(n)[None],
            "ples": ples.to(torch.bfloat16), "read_len": n, "rows": n}
    host = rank_hosts(checkpoint, run, i, parts)[0]
    traced, counts = trace_rank(host, [call])
    tensors = {"call0.xs": call["xs"].float(), "call0.positions": call["positions"]}
    if ple is not None:
        tensors["call0.ples"] = ples
    tensors.update({f"bits.{part}": recorded[f"bits.ref16.{name}"] for part, name in zip(parts, names)})
    meta = {"kind": "bits", "dtype": "bfloat16", "points": parts, "tp": 1, "target_rows": n,
            "settings": settings_record(run),
            "kv_shapes": [[list(t.shape) for t in host_cache(host)]], "departure_limit": DEPARTURE_LIMIT,
            "calls": [{"method": "call0", "sums": counts[0], "rows": n}],
            "description": f"layer {i} ({spec.layers[i].type}) of {checkpoint.path} (spec {spec.spec_hash()}) alone "
                           f"at TP 1 in bf16 on prompt {target.prompt}'s {n} rows (one chunk), against transformers' "
                           f"bf16 layer on the same input, bit for bit: {target.point} departed at "
                           f"{target.ratio:.1%} of its elements when recorded"}
    return save_repro(out_dir, tensors, meta, [traced_bytes(traced)], what=f"layer {i} alone, bit-exact, TP 1",
                      say=say, how="bit for bit on this CPU")


def snapshot_bundles(result, checkpoint, settings, out_dir, say=print) -> list:
    """`check --snapshot DIR`'s HLO bundles (harness/snapshot/hlo_bundle.py) of the call it snapshotted:
    the repro's layer hosts and the engine's calls, rebuilt; none for a host step or a bit-exact stage."""
    from harness.snapshot.hlo_bundle import maybe_write, write_layer_bundles
    from harness.snapshot.traced_layer import rank_hosts
    from harness.snapshot.target import BITS_STAGE, choose_target, stage_settings

    target = choose_target(result, settings)
    if target.host or target.stage == BITS_STAGE or target.point in LOGITS:
        say("no HLO bundle: the failure is not a layer's device call")
        return []
    stage = result.judged(target.stage)
    run = stage_settings(settings, target.stage)

    def write():
        _, calls, _ = repro_inputs(checkpoint, run, target, stage.observation)
        parts = [name.rsplit(".", 1)[1] for name in layer_points(target.layer, spec=checkpoint.spec)]
        return write_layer_bundles(checkpoint, run, target, rank_hosts(checkpoint, run, target.layer, parts), calls,
                                   out_dir=out_dir, say=say)
    return maybe_write(write, say)

