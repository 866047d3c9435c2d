"""Shared by the snapshot suites: a check (with or without a catalog fault) whose failing call is
snapshotted, replayed and emitted as a standalone repro, each with the fault still planted where
the test says, and the repro script run with this package made unimportable."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.base.errors import OptionError
from harness.base.settings import RunSettings

BLOCKER = "raise ImportError('a standalone repro must not import harness')\n"


@dataclass
class Flow:
    result: object
    manifest: dict
    lines: list = field(default_factory=list)
    replays: dict = field(default_factory=dict)  # (backend, mode, planted) -> BackendReplay
    repro_refused: str | None = None  # why --emit-repro refused this failure (a decode step's, KV sharing)


def run_check(checkpoint, references, settings: RunSettings, fp32: bool = True, local: bool = False):
    """check's two stages (the fp32 one unless `fp32` is False), with the local verdicts (and so the
    bit-exact layer stage) only when `local`."""
    from harness.backends import build_engine
    from harness.parity.check import check_port

    engine = build_engine(checkpoint, settings, capture=True)
    return check_port(checkpoint, engine, references["float32"], references["bfloat16"], local=local,
                      fp32_engine="auto" if fp32 else None)


def snapshot_flow(fault, checkpoint, references, settings: RunSettings, out: Path, repro: Path | None = None,
                  modes=("whole",), fp32: bool = True, other_tp: int | None = None, unplanted: bool = True,
                  local: bool = False) -> Flow:
    """Check with `fault` planted (None: the clean port), snapshot (and emit a repro) with it still
    planted, replay each mode on cpu planted, then (`unplanted`) whole again with the fault removed
    (`fp32` False: the check's bf16 stage only; `local`: with the local verdicts and the bit-exact
    layer stage)."""
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.repro import emit_repro
    from harness.snapshot.replay import replay
    from harness.snapshot.write import snapshot_check

    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        if fault is not None:
            fault.inject(mp)
        result = run_check(checkpoint, references, settings, fp32=fp32, local=local)
        manifest = snapshot_check(result, checkpoint, settings, out, source="check", say=lines.append)
        flow = Flow(result, manifest, lines)
        if repro is not None:
            try:
                emit_repro(result, checkpoint, settings, repro, say=lines.append)
            except OptionError as exc:
                flow.repro_refused = str(exc)
        snap = read_snapshot(out)
        for mode in modes:
            flow.replays[("cpu", mode, True)] = replay(snap, checkpoint, "cpu", mode=mode)
        if other_tp is not None:  # the same call at another TP degree (the port shards anew)
            flow.replays[(f"cpu-tp{other_tp}", "whole", True)] = replay(snap, checkpoint, "cpu", tp=other_tp)
    if unplanted:
        flow.replays[("cpu", "whole", False)] = replay(snap, checkpoint, "cpu")
    return flow


def planned_and_written(out: Path, manifest: dict) -> tuple[int, int]:
    written = sum(p.stat().st_size for p in out.iterdir())
    return manifest["planned_bytes"], written


# A stand-in for torch-neuronx with the documented signature of torch_neuronx.trace (Neuron SDK 2.x:
# trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,
# partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False)): it logs each call and
# traces on the CPU, so repro.py's --neuron path runs as far as a machine without a device allows.
NEURONX_STUB = """import json, os, torch
def trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,
          partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False):
    assert isinstance(func, torch.nn.Module) and isinstance(example_inputs, tuple)
    with open(os.environ["NEURONX_STUB_LOG"], "a") as f:
        f.write(json.dumps({"inputs": len(example_inputs), "workdir": compiler_workdir}) + "\\n")
    return torch.jit.trace(func, example_inputs, check_trace=False)
"""


def observation(references) -> SimpleNamespace:
    """What a stage observed, as the recorder reads it: the references stacked over prompts."""
    import torch

    ref32, ref16 = references["float32"], references["bfloat16"]
    names = ref32[0].captures
    stack = lambda runs: {n: torch.cat([r.captures[n] for r in runs]) for n in names}  # noqa: E731
    return SimpleNamespace(ref32=ref32, ref=stack(ref32), env=stack(ref16))


def control_target(references, settings: RunSettings, layer: int, prompt: int = 0, step: int | None = None):
    """A control Target without a check: prompt `prompt`'s last prefill chunk (it reads the cached
    rows of any earlier one) or its teacher-forced decode step `step`, at layer `layer`."""
    from harness.port.engine import chunk_plan
    from harness.snapshot.target import Target

    n = len(references["float32"][prompt].prompt)
    if step is not None:
        return Target(stage="bf16", point=f"decode.layers.{layer}.output", layer=layer, ratio=1.0, failing=False,
                      prompt=prompt, position=n + step, start=n + step, length=1, bucket=1, step=step)
    start, length, bucket = chunk_plan(n, settings.buckets, settings.kv_len)[-1]
    return Target(stage="bf16", point=f"layers.{layer}.output", layer=layer, ratio=1.0, failing=False, prompt=prompt,
                  position=start, start=start, length=length, bucket=bucket)


def run_repro(repro: Path, tmp: Path, *args: str, neuronx_stub: bool = False) -> subprocess.CompletedProcess:
    """repro.py in a fresh interpreter where `import harness` fails (and, with `neuronx_stub`,
    torch_neuronx is NEURONX_STUB, its calls logged to tmp/neuronx.log)."""
    blocker = tmp / "blocker" / "harness"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(blocker.parent)
    if neuronx_stub:
        stub = tmp / "neuronx-stub" / "torch_neuronx"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text(NEURONX_STUB)
        env["PYTHONPATH"] += os.pathsep + str(stub.parent)
        env["NEURONX_STUB_LOG"] = str(tmp / "neuronx.log")
    return subprocess.run([sys.executable, str(repro / "repro.py"), *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)


@contextlib.contextmanager
def through_the_double(mp, tmp_path: Path):
    """The neuron backend's own code through the NxD double (tests/nxd_double) inside monkeypatch
    `mp`: a compile cache under `tmp_path`, two visible cores of a 16-core host, and neuronx_distributed
    imported as the backend imports it."""
    from harness.backends import neuron_env
    from tests.nxd_double import installed

    mp.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "neuron-cache"))
    mp.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    mp.setattr(neuron_env, "neuron_core_count", lambda: 16)
    with installed(mp):
        neuron_env.import_neuronx_distributed()
        yield
