"""Measure the host plan (harness/plan/host_plan.py): `check` and `reference` in fresh processes on
random checkpoints of the 12B's structure at several sizes, peak RSS per phase, and the fit of the
plan's constants.

The checkpoints are the released 12B config (fixtures/configs/gemma-4-12b-it.json) scaled down:
hidden H, intermediate 4H, 16 query heads of H/16 (global 2H/16), 8 KV heads (1 global, k = v),
6 layers (five sliding, one full), vocab 8H (the embedding about 8% of the weights, as the 12B's),
random weights through transformers' own class (harness/inputs/tiny.py's draw), stored in bf16 as the
released checkpoint is. Each is cached under GEMMA_PARITY_CACHE.

Every run is a fresh child process (`--child`) that runs the command in-process and reports its
peak RSS (VmHWM) per phase: the child resets VmHWM (/proc/self/clear_refs, 5) at each phase boundary
of harness/parity/check.py (build the port, references, fp32 stage, bf16 stage + local verdicts,
served build) and reads it at the next. The plan's host_phases for the same spec are printed beside.

    python benchmarks/host_plan_fit.py --hidden 256,512,768 [--commands check,reference] [--out FILE]
    python benchmarks/host_plan_fit.py --fit FILE        # the fit of the runs in FILE (a JSON list)

Not a test (minutes per size on a busy two-core machine); tests/perf/test_host_plan_fit.py (slow
lane) runs check on one size the fit did not see and holds the plan within 15% of its peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS = 6
NEW_TOKENS = 4


# ---- the checkpoint -------------------------------------------------------------------------------

def scaled_config(hidden: int, layers: int = LAYERS) -> dict:
    from harness import FIXTURES_DIR

    config = json.loads((FIXTURES_DIR / "configs" / "gemma-4-12b-it.json").read_text())
    text = config["text_config"]
    head = max(16, hidden // 16)
    text.update(hidden_size=hidden, intermediate_size=4 * hidden, head_dim=head, global_head_dim=2 * head,
                num_hidden_layers=layers, vocab_size=8 * hidden, sliding_window=128, max_position_embeddings=4096,
                layer_types=[text["layer_types"][i % 6] for i in range(layers)])
    for key in ("boi_token_id", "eoi_token_id", "image_token_id", "video_token_id", "boa_token_id",
                "eoa_token_index"):
        config.pop(key, None)
    config["vision_config"], config["audio_config"] = None, None
    return config


def scaled_checkpoint(hidden: int) -> Path:
    """The cached scaled checkpoint of width `hidden` (built in a child process on first use, so
    the building never counts in a measurement)."""
    from harness.inputs.tiny import cache_dir

    path = cache_dir() / f"hostplan-12b-h{hidden}-l{LAYERS}-v1"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--build", str(hidden), str(path)], check=True,
                       env=_env())
    return path


def _build(hidden: int, out: Path) -> None:
    import torch
    import transformers

    from harness.base.atomic import atomic_directory
    from harness.inputs.tiny import randomize_for_margins

    config = scaled_config(hidden)
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    torch.manual_seed(0)
    model = transformers.Gemma4UnifiedForConditionalGeneration(transformers.Gemma4UnifiedConfig(**kwargs))
    randomize_for_margins(model, 0)
    model = model.to(torch.bfloat16)
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ---- one run in a child process ---------------------------------------------------------------------

class Phases:
    """Peak RSS per phase: VmHWM read and reset at each boundary."""

    def __init__(self):
        self.peaks: dict[str, int] = {}
        self.current = "setup"

    @staticmethod
    def hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")

    def enter(self, name: str) -> None:
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), self.hwm())
        Path("/proc/self/clear_refs").write_text("5")
        self.current = name

    def wrap(self, module, attr: str, name: str, after: str | None = None) -> None:
        inner = getattr(module, attr)

        def wrapped(*args, **kwargs):
            self.enter(name)
            try:
                return inner(*args, **kwargs)
            finally:
                if after:
                    self.enter(after)
        setattr(module, attr, wrapped)


def _child(command: str, argv: list[str], out: str) -> None:
    import harness.parity.check as check
    from harness.cli import main

    _resident_from_env()
    phases = Phases()
    phases.wrap(check, "build_port", "build port")
    phases.wrap(check, "load_references", "reference")
    phases.wrap(check, "_fp32_stage", "fp32 stage", after="bf16 stage")
    phases.wrap(check, "_local", "local verdicts", after="bf16 stage")
    import harness.parity.served as served

    phases.wrap(served, "check_served_build", "served build")
    start = time.perf_counter()
    try:
        code = main([command, *argv])
    except SystemExit as exc:
        code = exc.code
    phases.enter("end")
    Path(out).write_text(json.dumps({"exit": code, "seconds": round(time.perf_counter() - start, 1),
                                     "phases": phases.peaks, "peak": max(phases.peaks.values())}))


def _resident_from_env() -> None:
    """HOSTPLAN_FLOAT64_RESIDENT_MIB: stream the float64 envelope above this size (the 12B's regime on
    a small checkpoint), in the child and in the plan alike."""
    if os.environ.get("HOSTPLAN_FLOAT64_RESIDENT_MIB"):
        from harness.reference import float64

        float64.FLOAT64_RESIDENT_BYTES = int(os.environ["HOSTPLAN_FLOAT64_RESIDENT_MIB"]) << 20


def measure(command: str, hidden: int, prompts: str | None) -> dict:
    path = scaled_checkpoint(hidden)
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--checkpoint", str(path), "--new-tokens", str(NEW_TOKENS)]
        if prompts:
            argv += ["--prompts", prompts]
        if command == "reference":
            argv += ["--out", str(Path(tmp) / "golden")]
        out = Path(tmp) / "peak.json"
        subprocess.run([sys.executable, __file__, "--child", command, str(out), "--", *argv], env=_env(),
                       check=False, stdout=subprocess.DEVNULL)
        run = json.loads(out.read_text())
    streamed = os.environ.get("HOSTPLAN_FLOAT64_RESIDENT_MIB")
    return {"command": command, "hidden": hidden, "float64_resident_mib": streamed, **run, **plan_of(command, path)}


def plan_of(command: str, path: Path) -> dict:
    from harness.inputs.checkpoint import Checkpoint
    from harness.plan.host_plan import resource_plan

    _resident_from_env()
    spec = Checkpoint.open(path).spec
    plan = resource_plan(spec, 2, "bfloat16", 256, (64, 256), backend="cpu", rows=_rows())
    c = plan["commands"][command]
    return {"fp32_model_bytes": plan["fp32_model_bytes"], "plan_bytes": c["host_peak_bytes"],
            "plan_phases": c.get("host_phases", {})}


def _rows() -> int:
    """Positions the runs' prompts take (the default prompts, each with NEW_TOKENS decoded)."""
    from harness import FIXTURES_DIR

    return sum(len(p) + NEW_TOKENS for p in json.loads((FIXTURES_DIR / "prompts" / "default.json").read_text()))


def fit(runs: list[dict]) -> dict:
    """Per command: the least-squares line peak = base + k x (the plan's largest phase before its
    constants), over the sizes given, and each run's plan error."""
    from harness.plan.host_plan import counted_peak

    out = {}
    for command in sorted({r["command"] for r in runs}):
        rows = [r for r in runs if r["command"] == command]
        xs = [counted_peak(plan_of(command, scaled_checkpoint(r["hidden"]))["plan_phases"]) for r in rows]
        ys = [r["peak"] for r in rows]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 1.0
        out[command] = {"base_bytes": int(my - k * mx), "k": round(k, 3), "sizes": [r["hidden"] for r in rows]}
    return out


def main() -> None:
    if sys.argv[1:2] == ["--build"]:
        return _build(int(sys.argv[2]), Path(sys.argv[3]))
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2], sys.argv[5:], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", default="256,512,768")
    ap.add_argument("--commands", default="check,reference")
    ap.add_argument("--prompts", default=None, help="prompt file (default: the command's default prompts)")
    ap.add_argument("--out", default=None, help="append the runs to this JSON list")
    ap.add_argument("--fit", default=None, help="only fit the runs in this JSON list")
    args = ap.parse_args()
    runs = json.loads(Path(args.fit).read_text()) if args.fit else []
    if not args.fit:
        for hidden in [int(h) for h in args.hidden.split(",")]:
            for command in args.commands.split(","):
                run = measure(command, hidden, args.prompts)
                print(json.dumps(run), flush=True)
                runs.append(run)
                if args.out:
                    old = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else []
                    Path(args.out).write_text(json.dumps(old + [run], indent=1))
    print(json.dumps(fit(runs), indent=1))


if __name__ == "__main__":
    main()
