"""A whole device graph as an HLO bundle (docs/snapshot.md#a-graph-the-compiler-crashes-on), for a failure
that is the compile itself: one rank's graph of harness/port/graphs.py (weights as the module initialises
them, the KV cache zero) lowered by torch-xla with its state as outputs, its reference run on XLA's CPU
backend, the flags the Neuron backend's build passes for that graph, and the compiler release it
breaks; and the issue text a team files upstream, generated from any bundle."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from harness.bundle import hlo_text
from harness.bundle.runner import full_text
from harness.bundle.write import bundle_manifest, read_manifest, save_bundle


def graph_bundle(spec, out_dir, *, tag: str = "decode", tp: int = 1, kv_len: int = 64, neuronx_cc: str | None = None,
                 observed: str | None = None, say=print) -> Path:
    """Rank 0's `tag` graph (decode, or prefill_<bucket>) of `spec` at TP `tp` as a bundle in `out_dir`."""
    from harness.backends.neuron_bundle import compile_record, toolchain
    from harness.backends.xla_bundle import lower_call
    from harness.backends.xla_lower import build_graph_module, graph_tensors
    from harness.port.graphs import example_inputs, input_width, kv_buffer_names

    module = build_graph_module(spec, tp, kv_len, torch.bfloat16)
    length = 1 if tag == "decode" else int(tag.rsplit("_", 1)[1])
    inputs = dict(zip(("inputs_embeds", "positions", "last_index"),
                      example_inputs(length, input_width(spec), torch.bfloat16, last_row=True)))
    generator = torch.Generator().manual_seed(0)  # rows of embedding scale, so every layer's output is exercised
    inputs["inputs_embeds"] = torch.randn(inputs["inputs_embeds"].shape, generator=generator).to(torch.bfloat16)
    kv = kv_buffer_names(module)
    for name in kv:  # the cache starts empty (as graph_tensors gives it); weights stay as initialised
        module.get_buffer(name).zero_()

    def call(*args):
        out = module(*args)
        return (list(out) if isinstance(out, (tuple, list)) else [out]) + [module.get_buffer(n) for n in kv]
    with torch.no_grad():
        n_out = len(call(*inputs.values())) - len(kv)  # a dry run on the host: how many outputs
    for name in kv:
        module.get_buffer(name).zero_()
    names = ["logits"] + [f"output{k}" for k in range(1, n_out)] + [f"state.{n}" for n in kv]
    lowered = lower_call(module, call, inputs, names, tensors=graph_tensors(module)[0])
    with tempfile.TemporaryDirectory() as tmp:
        text = full_text(lowered.proto, Path(tmp))
    sliding = sum(layer.window is not None for layer in spec.layers)
    failure = {"what": observed or f"rank 0's {tag} graph of a {len(spec.layers)}-layer Gemma-4 decoder "
                                   f"({sliding} sliding-window layers) at TP {tp}",
               "where": f"graph {tag}, rank 0 of {tp}, KV length {kv_len}, bf16, weights as initialised",
               "graph": tag, "rank": 0, "tp": tp,
               **({"observed": f"{observed} (as reported upstream; this bundle was built off-chip, where no "
                               "neuronx-cc runs: compile it with the command above)"} if observed else {}),
               "collectives": "one module per rank: TP 1 has none" if tp == 1 else
                              "rank 0's graph with its all-reduce and all-gather kept (replica groups of all ranks)"}
    manifest, files = bundle_manifest(text=text, proto=lowered.proto, lowered_by=lowered.lowered_by,
                                      params=lowered.params, outputs=lowered.outputs, expected=lowered.expected,
                                      failure=failure, compile=compile_record(tag), toolchain=toolchain(neuronx_cc),
                                      instructions=hlo_text.count(text))
    files["ISSUE.md"] = issue_text(manifest).encode()
    return save_bundle(out_dir, manifest, files, say=say)


def issue_text(manifest_or_bundle) -> str:
    """The upstream report of a bundle: versions, the command, what happens, what is expected."""
    m = manifest_or_bundle if isinstance(manifest_or_bundle, dict) else read_manifest(manifest_or_bundle)
    neuron, f = m["toolchain"]["neuron"], m["failure"]
    versions = [f"- Neuron SDK {neuron['neuron_sdk']}"]
    versions += [f"- {name} {version} ({neuron['pip_source'][name]})" for name, version in neuron["pip"].items()]
    versions += [f"- {name}: {version}" for name, version in neuron["system"].items()]
    lines = [f"# neuronx-cc {neuron['neuronx-cc']}: {f['what']}", "", "## Versions", "", *versions,
             f"- target: {m['compile']['target']}", "", "## Command", "",
             "The HLO module is `module.hlo.pb` in the attached bundle (text: `module.hlo.txt`, "
             f"{m['module']['instructions']} instructions; lowered by {m['module']['lowered_by']}).", "",
             "```", m["compile"]["command"], "```", "",
             f"Flags as the framework passes them: `{m['compile']['flags']}`.", "", "## What happens", "",
             f.get("observed", f"{f['what']} ({f['where']}). `./check.sh neuron` in the bundle compiles the module "
                                "with the command above, runs it and compares its outputs."), "",
             "## What is expected", "",
             f"The module compiles, and its {len(m['outputs'])} outputs match `expected/*.npy` (the same module run "
             f"on XLA's CPU backend) within tolerance: {m['tolerance_why']}", "",
             "## To reproduce", "", "```", "./check.sh neuron   # compile, run, compare: exit 0 agree, 1 not",
             "./check.sh cpu      # the reference on XLA's CPU backend (jax)", "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    """`python -m harness.bundle.graph OUT [--tag decode] [--neuronx-cc VERSION]`: the tiny 12B's graph."""
    import argparse

    from harness.backends.neuron_packages import BROKEN_VERSIONS
    from harness.inputs.spec import load_spec
    from harness.inputs.tiny import TINY_CONFIG

    p = argparse.ArgumentParser(prog="python -m harness.bundle.graph")
    p.add_argument("out")
    p.add_argument("--config", default=str(TINY_CONFIG))
    p.add_argument("--tag", default="decode")
    p.add_argument("--neuronx-cc", dest="neuronx_cc", default="2.27.5334")
    args = p.parse_args(argv)
    known = BROKEN_VERSIONS.get("neuronx-cc", {}).get(args.neuronx_cc)
    observed = f"neuronx-cc {args.neuronx_cc} {known}" if known else None
    graph_bundle(load_spec(args.config), args.out, tag=args.tag, neuronx_cc=args.neuronx_cc, observed=observed)
    print(json.dumps({"issue": str(Path(args.out) / "ISSUE.md")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
