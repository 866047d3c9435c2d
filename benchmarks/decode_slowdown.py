"""Does `bench --runs auto` catch a planted +25% decode slowdown on this machine, as it is loaded?

Three `gemma-parity bench --runs auto` runs of the tiny model on the cpu backend, each in a fresh
child process: a baseline, a clean control, and one where every `Engine.decode_step` sleeps
`--slowdown` x its own duration after it returns (a +25% decode step, prefill untouched). Then
`perf compare` baseline vs planted (must exit 1, naming decode) and baseline vs control (must exit
0: no false alarm). The machine's load average is recorded around each run, and everything goes
to DIR/summary.json; docs/timings.md keeps the figures. Not a test: it takes minutes, and its
outcome depends on the load (that is what it measures).

    python benchmarks/decode_slowdown.py [--slowdown 0.25] [--time-cap 240] [--together] [--out DIR]

--together starts the three benches at once, so that each sees the same background load; run one
after another (the default) they see whatever load the machine has at the time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SIDES = ("baseline", "control", "planted")


def _child(argv: list[str]) -> int:
    """In the child: plant the slowdown (if any) into the engine, then run the CLI as a user would."""
    slowdown = float(os.environ.get("GEMMA_PARITY_PLANTED_SLOWDOWN", "0"))
    from harness.cli import main
    from harness.port import engine

    if slowdown > 0:
        real = engine.Engine.decode_step

        def slowed(self, *args, **kwargs):
            start = time.perf_counter()
            out = real(self, *args, **kwargs)
            time.sleep(slowdown * (time.perf_counter() - start))
            return out

        engine.Engine.decode_step = slowed
    return main(argv)


def _start(out: Path, side: str, args) -> tuple:
    env = dict(os.environ, GEMMA_PARITY_PLANTED_SLOWDOWN=str(args.slowdown if side == "planted" else 0))
    argv = [sys.executable, __file__, "--child", "bench", "--model", "tiny", "--runs", "auto",
            "--time-cap", str(args.time_cap), "--out", str(out / f"{side}.json")]
    return (side, os.getloadavg(), time.monotonic(),
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def _bench(out: Path, side: str, args) -> dict:
    return _finish(out, _start(out, side, args))


def _finish(out: Path, started: tuple) -> dict:
    side, load_before, start, proc = started
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"bench ({side}) exited {proc.returncode}:\n{stderr[-2000:]}")
    result = json.loads((out / f"{side}.json").read_text())
    decode = result["metrics"]["decode_ms_per_token"]
    return {"side": side, "runs": len(decode), "seconds": round(time.monotonic() - start, 1),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "decode_median_ms": sorted(decode)[len(decode) // 2],
            "auto": [line for line in stderr.splitlines() if "--runs auto" in line]}


def _compare(out: Path, current: str) -> dict:
    argv = [sys.executable, "-m", "harness", "perf", "compare", "--baseline", str(out / "baseline.json"),
            "--current", str(out / f"{current}.json"), "--json", str(out / f"compare-{current}.json")]
    proc = subprocess.run(argv, capture_output=True, text=True)
    comp = json.loads((out / f"compare-{current}.json").read_text())
    return {"current": current, "exit": proc.returncode, "regressed": [m["metric"] for m in comp.get("metrics", [])
                                                                         if m.get("regressed")],
            "text": proc.stdout.splitlines()}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return _child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slowdown", type=float, default=0.25, help="planted decode slowdown (0.25: +25%%)")
    p.add_argument("--time-cap", type=float, default=240.0, help="bench --time-cap per run (seconds)")
    p.add_argument("--out", type=Path, default=Path("decode-slowdown"), help="directory for the runs and summary")
    p.add_argument("--together", action="store_true", help="run the three benches at the same time, so that "
                   "each sees the same background load (sequential runs on a busy machine see different loads)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.together:
        runs = [_finish(args.out, s) for s in [_start(args.out, side, args) for side in SIDES]]
    else:
        runs = [_bench(args.out, side, args) for side in SIDES]
    compares = [_compare(args.out, "planted"), _compare(args.out, "control")]
    summary = {"slowdown": args.slowdown, "time_cap": args.time_cap, "together": args.together,
               "cpus": os.cpu_count(), "runs": runs,
               "compares": compares, "caught": compares[0]["exit"] == 1, "false_alarm": compares[1]["exit"] != 0}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "compares"}, indent=1))
    for c in compares:
        print(f"--- perf compare baseline vs {c['current']}: exit {c['exit']}", *c["text"], sep="\n")
    return 0 if summary["caught"] and not summary["false_alarm"] else 1


if __name__ == "__main__":
    sys.exit(main())
