"""The CPU backend's prefill against transformers' eager forward of the same model and dtype.

The port's CPU backend (two ranks in threads, per-rank shards, a real all-reduce) runs a bucket-64
prefill through the host engine; transformers runs `model(input_ids)` with attn_implementation
"eager" on the same checkpoint, dtype and prompt. Each side runs in a fresh child process (so
neither's memory or threads disturb the other), warms up once, then reports the median of
--repeats timed calls. The ratio port / transformers is what the harness's own CPU path costs over
the library it is judged against.

    python benchmarks/prefill_vs_transformers.py [--model tiny | --checkpoint DIR | --layers 6] \\
        [--dtype bf16] [--repeats 5] [--out FILE]

The default checkpoint is benchmarks/memory_reference.py's: the 12B's real widths with 6 layers
(built on first use, ~5 GB, cached). Not a test: it takes minutes at that width.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.base.settings import torch_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_reference import build_checkpoint, checkpoint_dir, warm_page_cache  # noqa: E402

from harness.perf import bench_prompt, write_json  # noqa: E402

SIDES = ("port", "transformers")
BUCKET = 64


def _timed(fn, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (all threads) ms per call; CPU time is less sensitive to a busy machine."""
    fn()  # warm-up: first-call allocations and lazy initialisation
    wall, cpu = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - cpu_start) * 1e3)
    return wall, cpu


def measure(side: str, path: Path, dtype_name: str, repeats: int) -> dict:
    from harness.inputs.checkpoint import Checkpoint

    dtype = torch_dtype(dtype_name)
    prompt = bench_prompt(Checkpoint.open(path).spec.vocab_size, BUCKET)
    if side == "port":
        from harness.backends import build_engine

        from harness.base.settings import RunSettings

        engine = build_engine(Checkpoint.open(path), RunSettings(dtype=dtype, buckets=(BUCKET,), kv_len=BUCKET + 16))
        samples = _timed(lambda: engine.prefill(prompt), repeats)
    else:
        from harness.reference.run import load_reference_model

        model = load_reference_model(path, dtype)
        ids = torch.tensor([prompt])

        def forward():
            with torch.no_grad():
                model(input_ids=ids)

        samples = _timed(forward, repeats)
    wall, cpu = samples
    return {"side": side, "dtype": dtype_name, "ms": wall, "median_ms": statistics.median(wall),
            "cpu_ms": cpu, "median_cpu_ms": statistics.median(cpu), "threads": torch.get_num_threads()}


def measure_in_child(side: str, path: Path, dtype_name: str, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--checkpoint", str(path), "--dtype", dtype_name,
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed with exit {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="a checkpoint directory")
    source.add_argument("--model", choices=("tiny",), help="the cached tiny fixture model")
    parser.add_argument("--layers", type=int, default=6, help="layers of the 12B-width checkpoint (default 6)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("reports/prefill_vs_transformers.json"))
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.checkpoint, args.dtype, args.repeats)))
        return 0
    if args.model == "tiny":
        from harness.inputs.tiny import tiny_checkpoint

        path = tiny_checkpoint(seed=0)
    else:
        path = args.checkpoint or checkpoint_dir(args.layers, 0)
        if not (path / "config.json").is_file():
            build_checkpoint(path, args.layers)
    warm_page_cache(path)
    rows = {side: measure_in_child(side, path, args.dtype, args.repeats) for side in SIDES}
    ratio = rows["port"]["median_ms"] / rows["transformers"]["median_ms"]
    cpu_ratio = rows["port"]["median_cpu_ms"] / rows["transformers"]["median_cpu_ms"]
    results = {"checkpoint": str(path), "dtype": args.dtype, "bucket": BUCKET, "runs": rows, "ratio": ratio,
               "cpu_ratio": cpu_ratio}
    for side, row in rows.items():
        print(f"{side:<13} prefill of {BUCKET} tokens ({args.dtype}): median {row['median_ms']:9.1f} ms wall, "
              f"{row['median_cpu_ms']:9.1f} ms CPU over {len(row['ms'])} calls ({row['threads']} threads)")
    print(f"ratio port / transformers: wall {ratio:.2f}, CPU {cpu_ratio:.2f}  ({path})")
    write_json(args.out, results, overwrite=True)  # a report: rewritten each run
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
