"""Peak resident memory of the streaming reference vs transformers' plain load, at the 12B's widths.

The checkpoint is random, bf16, with the 12B's real widths (hidden 3840, intermediate 15360, vocab
262144, 16 q heads; sliding layers 8 KV heads of 256, the full layer 1 KV head of 512 with k = v)
but only a few layers (default 6: five sliding, one full), so both sides fit on a 24 GB machine.
It is written one layer per safetensors shard, never holding more than one layer in memory.

Each measurement runs in a fresh subprocess and reports its peak RSS (VmHWM; see peak_rss_bytes):
  imports       python + torch + transformers + harness imported (the floor under both)
  streaming     harness.reference.stream.stream_prefill_captures: one decoder layer resident at a time
  transformers  Gemma4UnifiedForConditionalGeneration.from_pretrained + one forward
Both forwards run the same prompt; the table also compares their raw last-position logits.

    python benchmarks/memory_reference.py [--layers 6] [--dtypes fp32,bf16] [--prompts 1] [--out FILE]

With --prompts N, streaming runs the N prompts in one pass over the weights
(stream_prefill_captures_many) and transformers loads once and runs N forwards.

Not a test: it writes a ~5 GB checkpoint (cached under GEMMA_PARITY_CACHE) and takes minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness import FIXTURES_DIR
from harness.inputs.tiny import cache_dir
from harness.perf import bench_prompt, write_json

REAL_CONFIG = FIXTURES_DIR / "configs" / "gemma-4-12b-it.json"
MODES = ("imports", "streaming", "transformers")
TOP_K = 10
BUILD_VERSION = 2  # part of the cache directory name: bump when random_tensor changes


# ---- the checkpoint -------------------------------------------------------------------------------

def reduced_config(layers: int) -> dict:
    """The released 12B config with only `layers` layers: five sliding then one full, repeated."""
    config = json.loads(REAL_CONFIG.read_text())
    text = config["text_config"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = [text["layer_types"][i % 6] for i in range(layers)]
    config["dtype"] = "bfloat16"
    return config


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' class expects, from a meta-device instance (no memory used)."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    with torch.device("meta"):
        model = Gemma4UnifiedForConditionalGeneration(Gemma4UnifiedConfig(**kwargs))
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Well-conditioned random weights: 1/sqrt(fan_in) matrices (the embedding too, so the
    sqrt(hidden)-scaled input has unit entries and the tied lm_head gives logits of order 1, not
    60 that the softcap would flatten to ties at 30), norms near (not at) 1, layer_scalar 1."""
    if name.endswith("layer_scalar"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if len(shape) == 1:
        return (0.6 + 0.8 * torch.rand(shape, generator=gen)).to(torch.bfloat16)
    scale = shape[-1] ** -0.5
    out = torch.empty(shape, dtype=torch.bfloat16)
    for rows in torch.split(torch.arange(shape[0]), 16384):  # bounded fp32 scratch for the 2 GB embedding
        out[rows] = (torch.randn((len(rows), *shape[1:]), generator=gen) * scale).to(torch.bfloat16)
    return out


def shard_of(name: str) -> str:
    parts = name.split(".")
    if "layers" in parts:
        return f"layer-{int(parts[parts.index('layers') + 1]):03d}.safetensors"
    return "rest.safetensors"


def build_checkpoint(out_dir: Path, layers: int, seed: int = 0) -> Path:
    """Write the reduced checkpoint shard by shard, then the index and config (config.json last:
    its presence marks a complete directory)."""
    from safetensors.torch import save_file

    config = reduced_config(layers)
    shapes = tensor_shapes(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for shard in sorted({shard_of(n) for n in shapes}):
        names = [n for n in shapes if shard_of(n) == shard]
        tensors = {n: random_tensor(n, shapes[n], gen) for n in names}
        save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: shard for n in names})
        print(f"[memory] wrote {shard}", file=sys.stderr, flush=True)
        del tensors
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def checkpoint_dir(layers: int, seed: int) -> Path:
    blob = json.dumps([BUILD_VERSION, reduced_config(layers)], sort_keys=True).encode()
    digest = hashlib.sha256(blob).hexdigest()[:10]
    return cache_dir() / f"memref-{layers}layers-{digest}-seed{seed}"


# ---- one measurement, in a fresh process -----------------------------------------------------------

def top_k(logits_row: torch.Tensor) -> dict:
    values, ids = logits_row.float().topk(TOP_K)
    return {"ids": ids.tolist(), "values": values.tolist()}


def peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec, so a
    child's ru_maxrss is at least its parent's RSS at the fork (2.6 GiB here after the build)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def prompts_for(vocab_size: int, prompt_len: int, count: int) -> list[list[int]]:
    return [bench_prompt(vocab_size, prompt_len, seed=k) for k in range(count)]


def measure(mode: str, path: Path, dtype_name: str, prompt_len: int, count: int = 1) -> dict:
    """Run one mode and report peak RSS; called in a fresh child process so peaks never mix."""
    from harness.inputs.checkpoint import Checkpoint

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    start, cpu_start = time.perf_counter(), time.process_time()
    out = {"mode": mode, "dtype": dtype_name}
    if mode == "imports":
        import transformers.models.gemma4_unified.modeling_gemma4_unified  # noqa: F401

        import harness.reference.run  # noqa: F401
    elif mode == "streaming":
        from harness.reference.stream import stream_prefill_captures_many

        checkpoint = Checkpoint.open(path)
        prompts = prompts_for(checkpoint.spec.vocab_size, prompt_len, count)
        captures = stream_prefill_captures_many(checkpoint, prompts, dtype)
        out["top"] = top_k(captures[0]["logits"][-1])
    else:
        from transformers import Gemma4UnifiedForConditionalGeneration

        model = Gemma4UnifiedForConditionalGeneration.from_pretrained(path, dtype=dtype,
                                                                      attn_implementation="eager").eval()
        prompts = prompts_for(model.config.get_text_config().vocab_size, prompt_len, count)
        raw = []  # the lm_head output, before transformers applies the softcap
        model.lm_head.register_forward_hook(lambda module, args, output: raw.append(output))
        with torch.no_grad():
            for prompt in prompts:
                model(input_ids=torch.tensor([prompt]))
        out["top"] = top_k(raw[0][0, -1])
    out["seconds"] = time.perf_counter() - start
    out["cpu_seconds"] = time.process_time() - cpu_start  # all threads: less sensitive to a busy machine
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def warm_page_cache(path: Path, chunk: int = 64 * 2**20) -> None:
    """Read every shard once, so that no mode pays the disk for another (the first mode to read a
    freshly written checkpoint would otherwise be charged for it)."""
    for shard in sorted(path.glob("*.safetensors")):
        with open(shard, "rb") as f:
            while f.read(chunk):
                pass


def measure_in_child(mode: str, path: Path, dtype_name: str, prompt_len: int, count: int = 1) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--checkpoint", str(path), "--dtypes", dtype_name,
           "--prompt-len", str(prompt_len), "--prompts", str(count)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} ({dtype_name}) failed with exit {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the report ------------------------------------------------------------------------------------

def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def agreement(rows: list[dict]) -> dict:
    """Top-1 agreement and the largest top-k logit gap between the two forwards of one dtype."""
    by_mode = {r["mode"]: r["top"] for r in rows if "top" in r}
    s, t = by_mode["streaming"], by_mode["transformers"]
    common = [i for i in s["ids"] if i in t["ids"]]
    gap = max((abs(s["values"][s["ids"].index(i)] - t["values"][t["ids"].index(i)]) for i in common),
              default=float("nan"))
    return {"top1_equal": s["ids"][0] == t["ids"][0], "topk_overlap": len(common), "max_logit_gap": gap,
            "top1_logit": t["values"][0]}


def render(results: dict) -> str:
    lines = [f"{'dtype':<6} {'mode':<13} {'peak RSS GiB':>12} {'above imports':>13} {'seconds':>8} {'CPU s':>8}"]
    for dtype_name, rows in results["runs"].items():
        floor = next(r["peak_rss_bytes"] for r in rows if r["mode"] == "imports")
        for r in rows:
            lines.append(f"{dtype_name:<6} {r['mode']:<13} {gib(r['peak_rss_bytes']):>12} "
                         f"{gib(r['peak_rss_bytes'] - floor):>13} {r['seconds']:>8.1f} {r['cpu_seconds']:>8.1f}")
        wall = {r["mode"]: r["seconds"] for r in rows}
        cpu = {r["mode"]: r["cpu_seconds"] for r in rows}
        lines.append(f"{dtype_name:<6} time streaming / transformers: wall "
                     f"{wall['streaming'] / wall['transformers']:.2f}, CPU {cpu['streaming'] / cpu['transformers']:.2f}")
        a = results["agreement"][dtype_name]
        lines.append(f"{dtype_name:<6} top-1 equal: {a['top1_equal']}, top-{TOP_K} overlap "
                     f"{a['topk_overlap']}, max raw-logit gap {a['max_logit_gap']:.3g} (top-1 logit "
                     f"{a['top1_logit']:.3g})")
    lines.append(f"checkpoint: {results['checkpoint']} ({gib(results['checkpoint_bytes'])} GiB bf16 on disk, "
                 f"{results['layers']} layers, {results['prompts']} prompt(s) of {results['prompt_len']} tokens)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--prompt-len", type=int, default=64, help="the published bucket")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per run (streaming: one pass for all)")
    parser.add_argument("--checkpoint", type=Path, help="reuse this checkpoint directory")
    parser.add_argument("--out", type=Path, default=Path("reports/memory_reference.json"))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.checkpoint, args.dtypes, args.prompt_len, args.prompts)))
        return 0
    path = args.checkpoint or checkpoint_dir(args.layers, args.seed)
    if not (path / "config.json").is_file():
        build_checkpoint(path, args.layers, args.seed)
    results = {"checkpoint": str(path), "layers": args.layers, "prompt_len": args.prompt_len, "prompts": args.prompts,
               "checkpoint_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")),
               "runs": {}, "agreement": {}}
    warm_page_cache(path)
    for dtype_name in args.dtypes.split(","):
        rows = []
        for mode in MODES:
            print(f"[memory] {dtype_name} {mode}", file=sys.stderr, flush=True)
            rows.append(measure_in_child(mode, path, dtype_name, args.prompt_len, args.prompts))
        results["runs"][dtype_name] = rows
        results["agreement"][dtype_name] = agreement(rows)
    print(render(results))
    write_json(args.out, results, overwrite=True)  # a report: rewritten each run
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
