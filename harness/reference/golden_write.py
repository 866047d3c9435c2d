"""Writing a golden (the format harness/reference/golden.py reads): the references run for the
prompts, their tensors and manifest written into a temp directory, checked complete on disk, sealed
(harness/inputs/sealed.py) and renamed into place, never over anything but a golden this tool wrote."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from harness.base.atomic import atomic_directory
from harness.base.errors import GoldenError
from harness.reference.golden import GOLDEN, MANIFEST, _finite_or_refuse, is_golden_dir
from harness.reference.run import ReferenceResult


def _versions() -> dict:
    import transformers

    import harness

    return {"torch": torch.__version__, "transformers": transformers.__version__, "harness": harness.__version__}


def check_replaceable(out_dir, overwrite: bool) -> None:
    """An existing non-empty `out_dir` may only be replaced deliberately (`overwrite`) and only when
    it is a golden this tool wrote with nothing else in it: never a checkpoint or the user's files."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise GoldenError(f"{out_dir}: a golden (or other files) already exists there. Choose a new "
                          "--out directory or pass --overwrite to replace it deliberately.")
    if not is_golden_dir(out_dir):
        raise GoldenError(f"{out_dir}: --overwrite replaces only a golden written by `gemma-parity "
                          f"reference`, and this directory is not one (no golden {MANIFEST}); nothing was "
                          "touched. Choose a new --out directory.")
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in GOLDEN.files)
    if foreign:
        raise GoldenError(f"{out_dir}: holds files that are not part of the golden ({', '.join(foreign[:5])}); "
                          "--overwrite would delete them, so nothing was touched. Move them away or "
                          "choose a new --out directory.")



def write_golden(out_dir, spec, results: dict[str, list[ReferenceResult]], new_tokens: int,
                 checkpoint_hashes: dict[str, str] | None = None, checkpoint_path: str = "",
                 overwrite: bool = False, provenance: dict | None = None) -> Path:
    """The golden's two files, replaced as a whole. `provenance` (harness/base/provenance.py: the
    command's settings, the inputs' hashes, package versions, commit and dirty flag) goes into the
    manifest, under the golden's hash like everything in it."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir, overwrite)
    tensors, per_dtype = {}, {}
    prompts = None
    for dtype, runs in results.items():
        prompts = prompts or [r.prompt for r in runs]
        per_dtype[dtype] = [{"generated": r.generated} for r in runs]
        for k, r in enumerate(runs):
            for name, t in r.captures.items():
                tensors[f"{dtype}.p{k}.{name}"] = t.float().contiguous()
            tensors[f"{dtype}.p{k}.step_logits"] = r.step_logits.float().contiguous()
    _finite_or_refuse(tensors, "the reference")
    manifest = {
        "format_version": GOLDEN.version,
        "spec_hash": spec.spec_hash(),
        "num_layers": spec.num_layers,
        "checkpoint": {"path": str(checkpoint_path), "files": checkpoint_hashes or {}},
        "prompts": prompts or [],
        "new_tokens": new_tokens,
        "results": per_dtype,
        "versions": _versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if provenance is not None:
        manifest["provenance"] = provenance
    with atomic_directory(out_dir, replace=overwrite, final=True) as tmp:  # the commit point of `reference`
        GOLDEN.write(tmp, manifest, tensors, out_dir)
    return out_dir


@dataclass
class GoldenWritten:
    path: Path
    prompts: list[list[int]]
    new_tokens: int
    tokens: list[list[int]]  # the fp32 reference's greedy tokens per prompt


def make_golden(checkpoint_dir, out, prompts_path=None, new_tokens: int = 8, stream: bool = False,
                overwrite: bool = False, progress: bool = False, provenance: dict | None = None) -> GoldenWritten:
    """Run the fp32 and bf16 references for the prompts and write them as a golden at `out`.

    `stream` computes the prefill captures one decoder layer at a time from the shards (peak memory
    about the embeddings plus one layer) and decodes nothing."""
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.prompts import load_prompts, validate_prompt_fit, validate_prompt_ids
    from harness.reference.run import run_reference
    from harness.reference.stream import stream_prefill_captures_many

    ckpt = Checkpoint.open(checkpoint_dir)
    out = Path(out)
    check_replaceable(out, overwrite)
    prompts = load_prompts(prompts_path, checkpoint_dir)
    validate_prompt_ids(ckpt.spec, prompts, prompts_path)
    validate_prompt_fit(prompts, 0 if stream else new_tokens, prompts_path, max_positions=ckpt.spec.max_positions)
    ckpt.check_finite()
    if stream:  # one pass over the weights per dtype, all prompts at once
        results = {dtype: [ReferenceResult(p, dtype, captures, [], torch.empty(0, ckpt.spec.vocab_size))
                           for p, captures in zip(prompts, stream_prefill_captures_many(ckpt, prompts, dtype, progress))]
                   for dtype in ("float32", "bfloat16")}
        new_tokens = 0
    else:
        results = run_reference(checkpoint_dir, prompts, new_tokens, progress=progress)
    write_golden(out, ckpt.spec, results, new_tokens, ckpt.file_hashes(), str(checkpoint_dir), overwrite=overwrite,
                 provenance=provenance)
    return GoldenWritten(out, prompts, new_tokens, [r.generated for r in results["float32"]])
