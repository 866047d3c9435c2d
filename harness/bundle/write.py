"""Writing an HLO bundle (docs/snapshot.md#the-hlo-bundle): one module a compiler engineer compiles, runs
and compares with no Python of ours. The module as text and proto, each entry parameter's value and each
output's reference value as .npy, the tolerance of each output and why, the neuronx-cc command and the
toolchain, a README, the standalone runner (fixtures/bundle/run_hlo.py) and check.sh. bundle.json lists
every file with its sha256 (the runner refuses a missing or altered one). Written atomically."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import torch

from harness.base.atomic import atomic_directory

KIND = "gemma-parity HLO bundle"
FORMAT = 1
# Relative L2 error an output may differ from the reference run by. The module's values are bf16 (the
# f32 outputs are bf16 captures widened): a compiler free to reorder bf16 work moves elements by about
# half a bf16 unit on some of them, a relative L2 well under one unit (2^-8 relative, the bf16 spacing
# at 1.0 over 2); a wrong operand, constant or accumulation type moves an output by more. fp32-only
# outputs (f32 partial sums) get the same: they are sums of bf16 products.
TOLERANCE = 2.0 ** -8
TOLERANCE_WHY = ("relative L2 error (||run - expected|| / ||expected||) <= 2^-8 per output: the module computes "
                 "in bf16, and a compiler's own reordering of bf16 work moves an output by a fraction of a bf16 "
                 "unit (2^-8 relative); a wrong operand, constant or narrowed accumulation moves it by more. "
                 "Non-finite values must match exactly.")
HLO_OF_TORCH = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16", torch.float64: "f64",
                torch.int32: "s32", torch.int64: "s64", torch.int8: "s8", torch.uint8: "u8", torch.bool: "pred"}


def npy_bytes(t: torch.Tensor) -> bytes:
    """A plain array: bf16 widened to f32 (exact), everything else as is."""
    t = t.detach().cpu()
    array = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array))
    return buffer.getvalue()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def runner_script() -> str:
    import harness

    return (harness.FIXTURES_DIR / "bundle" / "run_hlo.py").read_text(encoding="utf-8")


CHECK_SH = """#!/bin/sh
# Compile, run and compare this bundle's HLO module (README.md). Usage: ./check.sh [cpu|neuron]
# (default: neuron where the Neuron SDK is installed, else cpu). Exit 0: outputs agree; 1: they do not
# (or the compiler failed); 2: the bundle cannot be judged here. Python: $PYTHON or python3.
HERE=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python3}" "$HERE/run_hlo.py" "$HERE" "$@"
"""


def readme(manifest: dict) -> str:
    f, m, c = manifest["failure"], manifest["module"], manifest["compile"]
    lines = [f"# HLO bundle: {f['what']}", "",
             f"Where: {f['where']}.", "",
             f"The module: `{m['text']}` (text) and `{m['proto']}` (serialized HloModuleProto), "
             f"{m['instructions']} instructions, {len(manifest['params'])} parameters, "
             f"{len(manifest['outputs'])} outputs; lowered by {m['lowered_by']}.", "",
             "## Run it", "",
             "    ./check.sh cpu      # XLA's CPU backend: pip install numpy 'jax[cpu]==0.10.2'",
             "    ./check.sh neuron   # neuronx-cc + the Neuron runtime, on an inf2 host", "",
             "Exit 0: every output within its tolerance; 1: an output moved (named) or the compile failed; 2: "
             "the bundle cannot be judged here (a missing or altered file, another toolchain).", "",
             "## The compile", "", f"    {c['command']}", "",
             f"Flags as the build passed them: `{c['flags']}` (target {c['target']}).", "",
             "## Toolchain", "", "```", json.dumps(manifest["toolchain"], indent=1), "```", "",
             "## Inputs and expected outputs", "",
             "`inputs/pNNN.npy`: entry parameter NNN in order (bf16 values stored widened to f32, exactly); "
             "`expected/oNNN.npy`: the module's output NNN from the reference run on XLA's CPU backend.", "",
             f"Tolerance: {manifest['tolerance_why']}", ""]
    lines += [f"- output {k} `{o['name']}` {o['dtype']}{o['shape']}" for k, o in enumerate(manifest["outputs"])]
    if manifest.get("test_module"):
        lines += ["", f"Test module: `{manifest['test_module']}` ({manifest.get('planted', '')}), run on cpu in "
                      "place of the module as a stand-in for a miscompile."]
    return "\n".join(lines) + "\n"


def bundle_manifest(*, text: str, proto: bytes | None, lowered_by: str, params, outputs, expected, failure: dict, compile: dict,
                    toolchain: dict, instructions: int) -> tuple[dict, dict[str, bytes]]:
    """bundle.json (without `files`) and every data file's bytes by relative path."""
    files: dict[str, bytes] = {"module.hlo.txt": text.encode()}
    if proto is not None:
        files["module.hlo.pb"] = proto
    from harness.bundle.runner import JAX_VERSION

    toolchain = {"neuron": toolchain, "cpu_runner": {"jax": JAX_VERSION, "jaxlib": JAX_VERSION}}
    manifest = {"kind": KIND, "format": FORMAT, "failure": failure, "compile": compile, "toolchain": toolchain,
                "module": {"text": "module.hlo.txt", "proto": "module.hlo.pb" if proto is not None else None, "lowered_by": lowered_by,
                           "instructions": instructions},
                "tolerance_why": TOLERANCE_WHY, "params": [], "outputs": []}
    from harness.hlo.ir import parse_hlo

    entry = parse_hlo(text).entry.parameters()
    for k, (name, value) in enumerate(params):
        value = value.reshape(entry[k].shape[0].dims)  # a lifted scalar comes back as [1]
        files[f"inputs/p{k:03d}.npy"] = npy_bytes(value)
        manifest["params"].append({"name": name, "file": f"inputs/p{k:03d}.npy", "dtype": HLO_OF_TORCH[value.dtype],
                                   "shape": list(value.shape)})
    for k, (name, value) in enumerate(zip(outputs, expected)):
        files[f"expected/o{k:03d}.npy"] = npy_bytes(value)
        manifest["outputs"].append({"name": name, "file": f"expected/o{k:03d}.npy",
                                    "dtype": HLO_OF_TORCH.get(value.dtype, str(value.dtype)),
                                    "shape": list(value.shape), "tolerance": TOLERANCE})
    return manifest, files


def save_bundle(out_dir, manifest: dict, files: dict[str, bytes], say=print) -> Path:
    """The files, the runner, check.sh, README and bundle.json (sha256 of each) into a new directory."""
    out_dir = Path(out_dir)
    files = dict(files)
    files["run_hlo.py"] = runner_script().encode()
    files["check.sh"] = CHECK_SH.encode()
    manifest = dict(manifest, files={rel: sha256_bytes(data) for rel, data in sorted(files.items())})
    files["README.md"] = readme(manifest).encode()
    with atomic_directory(out_dir) as tmp:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        (tmp / "bundle.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    (out_dir / "check.sh").chmod(0o755)
    say(f"HLO bundle written to {out_dir}: {manifest['module']['instructions']} instructions; run `{out_dir}/check.sh`")
    return out_dir


def read_manifest(bundle) -> dict:
    return json.loads((Path(bundle) / "bundle.json").read_text(encoding="utf-8"))
