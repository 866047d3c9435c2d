"""The HLO bundle of a snapshot's or repro's failing layer call (harness/bundle; docs/snapshot.md): the
repro's layer host of each rank (harness/snapshot/traced_layer.py) run through the engine's calls of the
prompt on the host (each rank's KV cache carried from call to call, each all-reduce given the ranks'
true fp32 sum, as repro.py does), then the failing call of each rank lowered by torch-xla: one module
per rank, its all-reduces cut at the rank's edge (the partial an output, the true sum an input), so each
module runs alone on one core. Written as `hlo-rank{r}/` beside the snapshot or repro."""

from __future__ import annotations

import tempfile
import types
from pathlib import Path

import torch

from harness.judge.compare import JUDGES


def unavailable() -> str | None:
    """Why no bundle can be written in this environment, or None."""
    from importlib.util import find_spec

    if find_spec("torch_xla") is None:
        return "no HLO bundle: lowering the module needs torch-xla (the XLA lane's environment, docs/xla-lane.md)"
    return None


def maybe_write(write, say=print):
    """Run `write` (the bundles of a call) where torch-xla can lower it; else say why not."""
    reason = unavailable()
    if reason is not None:
        say(reason)
        return []
    return write()


def _method(host, read_len: int):
    def call(self, *args):
        self.cache.read_len = read_len  # the call's KV bucket, fixed in its graph as in the repro
        return self.forward(*args)
    return types.MethodType(call, host)


def rank_inputs(hosts, calls) -> list[dict[str, torch.Tensor]]:
    """Each rank's inputs to the last call: its rows, positions, per-layer inputs, the KV cache the
    earlier calls left, and every all-reduce's true sum (fp32, rank order, cast back)."""
    from harness.snapshot.traced_layer import host_cache

    caches = [host_cache(h) for h in hosts]
    n = len(hosts[0].parts)
    for j, call in enumerate(calls):
        args = (call["xs"], call["positions"], call["ples"])
        run = [_method(h, call["read_len"]) for h in hosts]
        sums: list[torch.Tensor] = []
        with torch.no_grad():
            outs = [run[r](*args, *caches[r]) for r in range(len(hosts))]
            for _ in range(len(outs[0]) - n - 2 + 1):  # one pass more than there are reductions
                sums = [_sum([o[n + k] for o in outs]) for k in range(len(outs[0]) - n - 2)]
                outs = [run[r](*args, *caches[r], *sums) for r in range(len(hosts))]
        if j == len(calls) - 1:
            return [{"xs": args[0], "positions": args[1], "ples": args[2], "k": caches[r][0], "v": caches[r][1],
                     **{f"sum{k}": s for k, s in enumerate(sums)}} for r in range(len(hosts))]
        caches = [tuple(o[-2:]) for o in outs]
    raise ValueError("no call to bundle")


def _sum(partials):
    total = partials[0].float()
    for part in partials[1:]:
        total = total + part.float()
    return total.to(partials[0].dtype)


def write_layer_bundles(checkpoint, run, target, hosts, calls, out_dir, say=print) -> list[Path]:
    """One bundle per rank of the failing call into `out_dir`/hlo-rank{r}."""
    from harness.backends.neuron_bundle import compile_record, toolchain
    from harness.backends.xla_bundle import lower_call
    from harness.bundle.runner import full_text
    from harness.bundle.write import bundle_manifest, save_bundle
    from harness.hlo.ir import parse_hlo

    spec, i = checkpoint.spec, target.layer
    written = []
    for rank, (host, inputs) in enumerate(zip(hosts, rank_inputs(hosts, calls))):
        names = [f"layers.{i}.{p}" for p in host.parts]
        names += [f"all_reduce{k}.partial" for k in range(len(inputs) - 5)] + ["kv.k", "kv.v"]
        lowered = lower_call(host, _method(host, calls[-1]["read_len"]), inputs, names)
        with tempfile.TemporaryDirectory() as tmp:
            text = full_text(lowered.proto, Path(tmp))
        module = parse_hlo(text)
        verdict = "failing" if target.failing else "passing (a control)"
        failure = {"what": f"layer {i} ({spec.layers[i].type}) of {Path(str(checkpoint.path)).name} at TP {run.tp}, "
                           f"rank {rank}: the {target.graph_tag} call, {target.stage} stage: {target.point} "
                           f"{target.ratio:.3g}x its envelope ({verdict})",
                   "where": f"layer {i}, point {target.point}, graph {target.graph_tag}, prompt {target.prompt}, "
                            f"rows {target.start}..{target.start + target.length - 1}, rank {rank} of {run.tp}",
                   "layer": i, "point": target.point, "graph": target.graph_tag, "rank": rank, "tp": run.tp,
                   "ratio": target.ratio, "failing": target.failing,
                   "judge": {"factor": JUDGES[target.stage].factor, "floor": JUDGES[target.stage].floor},
                   "collectives": "one module per rank: each all-reduce's partial is an output, its sum "
                                  "across ranks an input (the true sum, from the reference run)"}
        manifest, files = bundle_manifest(
            text=text, proto=lowered.proto, lowered_by=lowered.lowered_by, params=lowered.params,
            outputs=lowered.outputs, expected=lowered.expected, failure=failure,
            compile=compile_record(target.graph_tag, run.backend_options.get("compiler_args")), toolchain=toolchain(),
            instructions=sum(1 for _ in module.all_instructions()))
        written.append(save_bundle(Path(out_dir) / f"hlo-rank{rank}", manifest, files, say=say))
    return written
