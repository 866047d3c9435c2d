"""Shared by the snapshot suites: a check (with or without a catalog fault) whose failing call is
snapshotted, replayed and emitted as a standalone repro, each with the fault still planted where
the test says, and the repro script run with this package made unimportable."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

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


def run_check(checkpoint, references, settings: RunSettings, fp32: bool = True):
    """check's two stages (the fp32 one unless `fp32` is False), no local verdicts."""
    from harness.backends import build_engine
    from harness.parity.check import check_port

    engine = build_engine(checkpoint, settings, capture=True)
    return check_port(checkpoint, engine, references["float32"], references["bfloat16"], local=False,
                      fp32_engine="auto" if fp32 else None)


def snapshot_flow(fault, checkpoint, references, settings: RunSettings, out: Path, repro: Path | None = None,
                  modes=("whole",), fp32: bool = True, other_tp: int | None = None) -> Flow:
    """Check with `fault` planted (None: the clean port), snapshot (and emit a repro) with it still
    planted, replay each mode on cpu planted, then whole again with the fault removed (`fp32`
    False: the check's bf16 stage only)."""
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.repro import emit_repro
    from harness.snapshot.replay import replay
    from harness.snapshot.write import snapshot_check

    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        if fault is not None:
            fault.inject(mp)
        result = run_check(checkpoint, references, settings, fp32=fp32)
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
    flow.replays[("cpu", "whole", False)] = replay(snap, checkpoint, "cpu")
    return flow


def planned_and_written(out: Path, manifest: dict) -> tuple[int, int]:
    written = sum(p.stat().st_size for p in out.iterdir())
    return manifest["planned_bytes"], written


def run_repro(repro: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """repro.py in a fresh interpreter where `import harness` fails."""
    blocker = tmp / "blocker" / "harness"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(blocker.parent)
    return subprocess.run([sys.executable, str(repro / "repro.py"), *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)
