"""The `gemma-parity` command: info, reference, check, bisect, bench and perf compare."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from harness.errors import HarnessInputError

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


def write_json_atomic(path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _add_model_args(p, config: bool = False):
    group = p.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", metavar="DIR", help="local checkpoint directory (config.json + *.safetensors)")
    if config:
        group.add_argument("--config", metavar="FILE", help="a config.json (no weights needed)")
    group.add_argument("--model", choices=["tiny"], help="the embedded tiny 12B-shaped model (built and cached on first use)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model (default 0)")


def _checkpoint_dir(args) -> Path:
    from harness.checkpoint import tiny_checkpoint

    if getattr(args, "checkpoint", None):
        return Path(args.checkpoint)
    return tiny_checkpoint(seed=args.seed)


def buckets_arg(text: str) -> tuple[int, ...]:
    try:
        buckets = tuple(sorted(int(b) for b in text.split(",") if b.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--buckets {text!r}: expected comma-separated integers like 16,64")
    if not buckets or min(buckets) < 1:
        raise argparse.ArgumentTypeError(f"--buckets {text!r}: need at least one positive bucket")
    return buckets


# ---- info -----------------------------------------------------------------------------------------

def info_payload(spec, tp: int, dtype: str = "bfloat16", kv_len: int = 256) -> dict:
    from harness.sharding import plan_layer
    from harness.spec import bytes_per_rank

    layers = []
    for layer in spec.layers:
        plan = plan_layer(layer, tp)
        layers.append({"index": layer.index, "type": layer.type, "head_dim": layer.head_dim,
                       "q_heads": layer.q_heads, "kv_heads": layer.kv_heads, "k_eq_v": layer.k_eq_v,
                       "window": layer.window, "rope_type": layer.rope_type, "rope_theta": layer.rope_theta,
                       "rotated_freqs": layer.rotated_freqs, "q_heads_per_rank": plan.q_heads_per_rank,
                       "kv_heads_per_rank": plan.kv_heads_per_rank, "groups": plan.groups,
                       "kv_layout": plan.kv_layout})
    memory = bytes_per_rank(spec, tp, dtype, kv_len)
    return {"spec_hash": spec.spec_hash(), "source": spec.source, "tp": tp, "dtype": dtype,
            "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
            "final_logit_softcapping": spec.final_logit_softcapping, "inert": spec.describe_inert(),
            "layers": layers, "bytes_per_rank": memory["total"], "memory": memory}


def cmd_info(args) -> int:
    from harness.report import format_info
    from harness.spec import load_spec

    if args.config:
        spec = load_spec(args.config)
    else:
        from harness.checkpoint import Checkpoint

        ckpt = Checkpoint.open(_checkpoint_dir(args))
        spec = ckpt.spec
        print(ckpt.describe())
    payload = info_payload(spec, args.tp, args.dtype, args.kv_len)
    print(format_info(payload))
    if args.json:
        write_json_atomic(args.json, payload)
    return EXIT_OK


# ---- reference ------------------------------------------------------------------------------------

def cmd_reference(args) -> int:
    from harness.checkpoint import Checkpoint
    from harness.golden import write_golden
    from harness.parity import load_prompts, validate_prompt_ids
    from harness.reference import run_reference, stream_prefill_captures

    ckpt_dir = _checkpoint_dir(args)
    ckpt = Checkpoint.open(ckpt_dir)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise HarnessInputError(f"{out}: already exists; choose a new --out or pass --overwrite")
    prompts = load_prompts(args.prompts, ckpt_dir)
    validate_prompt_ids(ckpt.spec, prompts, args.prompts)
    ckpt.check_finite()
    if args.stream:
        from harness.reference import ReferenceResult

        results = {}
        for dtype in ("float32", "bfloat16"):
            results[dtype] = []
            for k, p in enumerate(prompts):
                print(f"[stream {dtype}] prompt {k + 1}/{len(prompts)}", file=sys.stderr, flush=True)
                results[dtype].append(ReferenceResult(p, dtype, stream_prefill_captures(ckpt, p, dtype),
                                                      [], torch.empty(0, ckpt.spec.vocab_size)))
        new_tokens = 0
    else:
        results = run_reference(ckpt_dir, prompts, args.new_tokens, progress=True)
        new_tokens = args.new_tokens
    write_golden(out, ckpt.spec, results, new_tokens, ckpt.file_hashes(), str(ckpt_dir), overwrite=args.overwrite)
    tokens = [r.generated for r in results["float32"]]
    print(f"golden written to {out}: {len(prompts)} prompt(s), {new_tokens} new token(s); fp32 tokens {tokens}")
    return EXIT_OK


# ---- check ----------------------------------------------------------------------------------------

def reference_source(args, ckpt, ckpt_dir):
    """The golden (read and verified) or the validated prompts: every input checked before any
    expensive work starts."""
    from harness.golden import read_golden
    from harness.parity import load_prompts, validate_prompt_ids

    if args.golden:
        return read_golden(args.golden, expected_spec=ckpt.spec)
    prompts = load_prompts(args.prompts, ckpt_dir)
    validate_prompt_ids(ckpt.spec, prompts, args.prompts)
    return prompts


def load_references(source, ckpt_dir, new_tokens: int):
    """(fp32, bf16) reference results: from a golden, or computed now for the prompts."""
    from harness.golden import Golden
    from harness.reference import run_reference

    if isinstance(source, Golden):
        return source.results("float32"), source.results("bfloat16")
    refs = run_reference(ckpt_dir, source, new_tokens, progress=True)
    return refs["float32"], refs["bfloat16"]


def cmd_check(args) -> int:
    from harness.checkpoint import Checkpoint
    from harness.engine import build_engine
    from harness.parity import check_port
    from harness.reference import dtype_name, torch_dtype
    from harness.report import format_check, write_report

    ckpt_dir = _checkpoint_dir(args)
    ckpt = Checkpoint.open(ckpt_dir)
    print(ckpt.describe())
    source = reference_source(args, ckpt, ckpt_dir)
    dtype = torch_dtype(args.dtype)
    # The backend before the reference: a missing SDK or a bad TP degree is reported before minutes
    # of reference work, and loading the shards checks every weight for NaN/Inf (Checkpoint.get)
    # before transformers (which does not) computes the reference. A parity build: the per-layer
    # captures are extra graph outputs on the device.
    engine = build_engine(ckpt, backend=args.backend, tp=args.tp, dtype=dtype, buckets=args.buckets,
                          kv_len=args.kv_len, capture=True)
    ref32, ref16 = load_references(source, ckpt_dir, args.new_tokens)
    result = check_port(ckpt, engine, ref32, ref16, backend=args.backend, tp=args.tp,
                        dtype=dtype_name(dtype), progress=True)
    print(format_check(result))
    payload = result.to_json()
    if args.json:
        write_json_atomic(args.json, payload)
    if args.report:
        write_report(args.report, "check", payload, ckpt.spec)
    return EXIT_OK if result.passed else EXIT_FAIL


# ---- parser ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gemma-parity",
        description="Gemma-4 12B on Inferentia2 (TP=2): run the port, prove parity with the CPU fp32 "
                    "reference layer by layer, bisect divergences, and watch performance.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="resolved per-layer spec, TP sharding plan and bytes per rank")
    _add_model_args(p, config=True)
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="device dtype for the memory estimate")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length for the memory estimate")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("reference", help="run the CPU fp32 and bf16 reference and write a golden")
    _add_model_args(p)
    p.add_argument("--prompts", metavar="FILE", help="JSON list of token-id lists (or strings with a tokenizer)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens to decode (default 8)")
    p.add_argument("--stream", action="store_true",
                   help="prefill captures one layer at a time (peak memory ~ embeddings + one layer); no decode")
    p.add_argument("--out", required=True, metavar="DIR", help="golden directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing golden deliberately")
    p.set_defaults(func=cmd_reference)

    p = sub.add_parser("check", help="run the port and compare every layer and token with the reference")
    _add_model_args(p)
    p.add_argument("--golden", metavar="DIR", help="reuse a golden instead of recomputing the reference")
    p.add_argument("--backend", choices=["cpu", "neuron", "xla"], default="cpu")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="port dtype: bfloat16 (default) or float32")
    p.add_argument("--prompts", metavar="FILE", help="JSON list of token-id lists (default: fixtures/prompts/default.json)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens to decode (default 8)")
    p.add_argument("--buckets", type=buckets_arg, default=(64,), help="prefill buckets, e.g. 16,64 (default 64)")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length (default 256)")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    p.add_argument("--report", metavar="DIR", help="write a Markdown summary, the JSON and a PNG plot")
    p.set_defaults(func=cmd_check)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    """Commands that live beside their logic: bisect (bisect.py), bench and perf (perf.py), graphs
    (graph_stats.py)."""
    from harness.bisect import add_bisect_command
    from harness.graph_stats import add_graphs_command
    from harness.perf import add_perf_commands

    add_bisect_command(sub)
    add_perf_commands(sub)
    add_graphs_command(sub)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except HarnessInputError as exc:
        print(f"gemma-parity {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
