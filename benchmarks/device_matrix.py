"""The device experiment matrix: build and bench each variant most likely to move the prefill toward
its roofline floor, judge it by `check` (parity must hold) and by `perf compare` against the baseline
build, and write one Markdown table.

On an inf2 host (after `gemma-parity doctor`; each variant is two builds, parity and perf, so a cold
run of the whole matrix on the 12B takes many hours; compiled builds are cached):

    python benchmarks/device_matrix.py --checkpoint ~/models/gemma-4-12B-it --prompts short.json \\
        --runs 20 --out matrix.md --json matrix.json

Variants (docs/neuron.md#the-device-experiment-matrix says what each is expected to change and why):
    baseline        the shipped build: the default flags, decode as the layout priority, fp32 reduce
    cc-overlap      + --tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2'
    dge-offsets     + --internal-enable-dge-levels vector_dynamic_offsets
    nxdi-gemma3     NxD-Inference Gemma3's whole flag set (both of the above and
                    --enable-mixed-precision-accumulation)
    layout-prefill  weight layout optimised for the largest prefill graph instead of decode
    layout-none     no weight layout optimisation
    reduce-bf16     row-parallel all-reduce in bf16 (NxD-Inference's choice) instead of fp32
    device-argmax   listed, not yet available: greedy argmax in the decode graph needs the engine to
                    take token ids from the device
    prompt-attention listed, not yet available: prefill attending over the prompt only waits for the
                    long-context work (chunked prefill)

Exit status: 0 when every variant that ran kept parity, 1 when one lost it, 2 on bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

BASE_FLAGS = ("--enable-saturate-infinity", "--model-type=transformer", "--auto-cast=none", "-O1", "--target", "inf2")
OVERLAP = "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2"
DGE = ("--internal-enable-dge-levels", "vector_dynamic_offsets")


@dataclass
class Variant:
    name: str
    change: str
    options: dict = field(default_factory=dict)  # NeuronBackend build options
    unavailable: str | None = None  # why it cannot be built yet


def variants() -> list[Variant]:
    """Each variant's backend options, as `--backend-option` would give them (text, converted by the
    Neuron backend's declared OPTIONS)."""
    flags = list(BASE_FLAGS)
    return [
        Variant("baseline", "the shipped build"),
        Variant("cc-overlap", "collective/compute overlap, pipeline tiling 2",
                {"compiler_args": shlex.join([*flags, OVERLAP])}),
        Variant("dge-offsets", "vector dynamic-offset DGE", {"compiler_args": shlex.join([*flags, *DGE])}),
        Variant("nxdi-gemma3", "NxD-Inference Gemma3 flags",
                {"compiler_args": shlex.join([*flags, "--enable-mixed-precision-accumulation", OVERLAP, *DGE])}),
        Variant("decode-dge", "vector dynamic-offset DGE for the decode graphs only (per-graph flags)",
                {"decode_compiler_args": shlex.join([*flags, *DGE])}),
        Variant("layout-prefill", "weight layout for the prefill graph", {"layout_priority": "prefill"}),
        Variant("layout-none", "no weight layout optimisation", {"layout_priority": "none"}),
        Variant("reduce-bf16", "row-parallel all-reduce in bf16", {"reduce_dtype": "bf16"}),
        Variant("device-argmax", "greedy argmax on the device",
                unavailable="needs an engine path that takes token ids from the device graph"),
        Variant("prompt-attention", "prefill attends over the prompt only",
                unavailable="waits for the long-context work (chunked prefill, issue 21)"),
    ]


@contextlib.contextmanager
def recording(built: list):
    """Record every backend made inside the block (for its compile time and build facts)."""
    import harness.backends as backends

    real = backends.make_backend

    def make(*args, **kwargs):
        backend = real(*args, **kwargs)
        built.append(backend)
        return backend

    backends.make_backend = make
    try:
        yield
    finally:
        backends.make_backend = real


def run_variant(variant: Variant, ckpt, args, prompts) -> dict:
    """Parity (a parity build, judged by check) and speed (a perf build, benched) of one variant."""
    from harness.base.settings import RunSettings
    from harness.parity.check import run_parity_check
    from harness.perf import run_bench

    settings = RunSettings(backend=args.backend, tp=args.tp, dtype="bfloat16", buckets=args.buckets,
                           kv_len=args.kv_len, backend_options=variant.options)
    built: list = []
    with recording(built):
        check = run_parity_check(ckpt, args.checkpoint_dir, settings, prompts=prompts, new_tokens=args.new_tokens,
                                 fp32_stage=False)
        bench = run_bench(ckpt, settings, runs=args.runs, warmup=args.warmup, new_tokens=args.new_tokens,
                          progress=False)
    neuron = [be for be in built if getattr(be, "name", None) == "neuron"]
    return {"variant": variant.name, "change": variant.change, "passed": bool(check.passed), "bench": bench,
            "compile_s": sum(be.timings.get("build_s", 0.0) for be in neuron),
            "compiled": any(be.compiled for be in neuron), "builds": len(neuron)}


def _p50(result: dict, metric: str) -> float:
    return result["latency_summary"][metric]["p50"]


def _efficiency(result: dict, graph: str) -> float | None:
    row = next((g for g in result["roofline"]["graphs"] if g["graph"] == graph), None)
    return None if row is None else row["efficiency"]


def _vs(comparison, metric: str) -> str:
    m = next((m for m in comparison.metrics if m.metric == metric), None)
    if m is None or m.ratio is None:
        return "-"
    return f"{m.ratio:.3f}x ({m.verdict.split(':')[0]})"  # the verdict's head: the full text is in --json


def table(rows: list[dict], baseline: dict | None, buckets) -> str:
    from harness.perf.compare import compare_results

    headline = 64 if 64 in buckets else max(buckets)
    lines = ["| variant | change | TTFT p50 ms | TPOT p50 ms | prefill vs baseline | decode vs baseline | "
             "prefill / floor | decode / floor | parity | compile s |", "|" + "---|" * 10]
    for row in rows:
        if "unavailable" in row:
            lines.append(f"| {row['variant']} | {row['change']} | not yet available: {row['unavailable']} "
                         "| | | | | | | |")
            continue
        bench = row["bench"]
        comp = compare_results(baseline, bench, allow_mismatch=True, intervals=False) if baseline else None
        eff = [_efficiency(bench, f"prefill[{headline}]"), _efficiency(bench, "decode")]
        cells = [row["variant"], row["change"], f"{_p50(bench, 'ttft_ms'):.2f}", f"{_p50(bench, 'tpot_ms'):.2f}",
                 _vs(comp, "prefill_ms") if comp else "-", _vs(comp, "decode_ms_per_token") if comp else "-",
                 *[f"{100 * e:.3g}%" if e else "-" for e in eff], "PASS" if row["passed"] else "**FAIL**",
                 f"{row['compile_s']:.1f}" if row["compiled"] else "cached"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    from harness.base.settings import parse_buckets

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (the real 12B on inf2)")
    src.add_argument("--model", choices=["tiny"], help="the embedded tiny model (CPU runs through the double)")
    p.add_argument("--backend", default="neuron", choices=["neuron"], help="the backend every variant builds")
    p.add_argument("--variants", help="comma-separated names to run (default: all available; baseline always)")
    p.add_argument("--prompts", metavar="FILE", help="prompts judged by check (default: the check's defaults)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--buckets", type=parse_buckets, default=(64, 256))
    p.add_argument("--kv-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", metavar="FILE", required=True, help="the Markdown table")
    p.add_argument("--json", metavar="FILE", help="also every variant's verdict and bench result")
    return p.parse_args(argv)


def select(names: str | None) -> list[Variant]:
    from harness.base.errors import HarnessInputError

    every = variants()
    if names is None:
        return every
    wanted = {n.strip() for n in names.split(",") if n.strip()} | {"baseline"}
    unknown = wanted - {v.name for v in every}
    if unknown:
        raise HarnessInputError(f"--variants: unknown {sorted(unknown)}; choose from {[v.name for v in every]}")
    return [v for v in every if v.name in wanted]


def main(argv=None) -> int:
    from harness.base.atomic import write_json_atomic, write_text_atomic
    from harness.base.errors import HarnessInputError
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.prompts import load_prompts
    from harness.inputs.tiny import tiny_checkpoint

    args = parse_args(argv)
    try:
        chosen = select(args.variants)
        args.checkpoint_dir = Path(args.checkpoint) if args.checkpoint else tiny_checkpoint(seed=0)
        ckpt = Checkpoint.open(args.checkpoint_dir)
        prompts = load_prompts(args.prompts, args.checkpoint_dir)
        rows = []
        for variant in chosen:
            if variant.unavailable:
                rows.append({"variant": variant.name, "change": variant.change, "unavailable": variant.unavailable})
                continue
            print(f"device matrix: {variant.name} ({variant.change})", file=sys.stderr)
            rows.append(run_variant(variant, ckpt, args, prompts))
    except HarnessInputError as exc:
        print(f"device_matrix: error: {exc}", file=sys.stderr)
        return 2
    baseline = next(r["bench"] for r in rows if r["variant"] == "baseline")
    text = table(rows, baseline, args.buckets)
    write_text_atomic(args.out, text)
    if args.json:
        write_json_atomic(args.json, {"variants": rows})
    print(text, end="")
    return 0 if all(r.get("passed", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
