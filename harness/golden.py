"""Golden files: reference tensors in safetensors plus a JSON manifest with hashes and provenance.

A golden directory holds `manifest.json` and `tensors.safetensors`. It is written into a temp
directory and renamed into place (nothing half written), never over an existing golden unless asked,
and reading verifies the tensor file's hash and that the golden was made for the expected spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harness.atomic import atomic_directory
from harness.checkpoint import sha256_file
from harness.errors import GoldenError
from harness.reference import ReferenceResult

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"


def _versions() -> dict:
    import transformers

    import harness

    return {"torch": torch.__version__, "transformers": transformers.__version__, "harness": harness.__version__}


def write_golden(out_dir, spec, results: dict[str, list[ReferenceResult]], new_tokens: int,
                 checkpoint_hashes: dict[str, str] | None = None, checkpoint_path: str = "",
                 overwrite: bool = False) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise GoldenError(f"{out_dir}: a golden (or other files) already exists there. Choose a new "
                          "--out directory or pass --overwrite to replace it deliberately.")
    tensors, per_dtype = {}, {}
    prompts = None
    for dtype, runs in results.items():
        prompts = prompts or [r.prompt for r in runs]
        per_dtype[dtype] = [{"generated": r.generated} for r in runs]
        for k, r in enumerate(runs):
            for name, t in r.captures.items():
                tensors[f"{dtype}.p{k}.{name}"] = t.float().contiguous()
            tensors[f"{dtype}.p{k}.step_logits"] = r.step_logits.float().contiguous()
    manifest = {
        "format_version": FORMAT_VERSION,
        "spec_hash": spec.spec_hash(),
        "num_layers": spec.num_layers,
        "checkpoint": {"path": str(checkpoint_path), "files": checkpoint_hashes or {}},
        "prompts": prompts or [],
        "new_tokens": new_tokens,
        "results": per_dtype,
        "versions": _versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with atomic_directory(out_dir, replace=overwrite) as tmp:
        save_file(tensors, str(tmp / TENSORS))
        manifest["tensors_sha256"] = sha256_file(tmp / TENSORS)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out_dir


class Golden:
    """A verified golden: manifest plus lazily regrouped reference results per dtype."""

    def __init__(self, path: Path, manifest: dict, tensors: dict[str, torch.Tensor]):
        self.path, self.manifest, self.tensors = path, manifest, tensors

    @property
    def prompts(self) -> list[list[int]]:
        return self.manifest["prompts"]

    @property
    def new_tokens(self) -> int:
        return int(self.manifest["new_tokens"])

    def results(self, dtype: str) -> list[ReferenceResult]:
        if dtype not in self.manifest["results"]:
            raise GoldenError(f"{self.path}: no {dtype} reference in this golden "
                              f"(has {sorted(self.manifest['results'])}); regenerate it with "
                              "`gemma-parity reference`")
        runs = []
        for k, prompt in enumerate(self.prompts):
            prefix = f"{dtype}.p{k}."
            caps = {key[len(prefix):]: t for key, t in self.tensors.items() if key.startswith(prefix)}
            step_logits = caps.pop("step_logits")
            runs.append(ReferenceResult(prompt=prompt, dtype=dtype, captures=caps,
                                        generated=self.manifest["results"][dtype][k]["generated"],
                                        step_logits=step_logits))
        return runs


def read_golden(path, expected_spec=None) -> Golden:
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise GoldenError(f"{path}: no {MANIFEST}. Pass a directory written by `gemma-parity reference`.")
    try:
        manifest = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as exc:
        raise GoldenError(f"{manifest_file}: not valid JSON ({exc}); the golden is corrupted, "
                          "regenerate it with `gemma-parity reference`") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"{manifest_file}: format_version {manifest.get('format_version')!r}, "
                          f"this harness reads {FORMAT_VERSION}; regenerate the golden")
    tensor_file = path / TENSORS
    if not tensor_file.is_file():
        raise GoldenError(f"{tensor_file}: missing; the golden is incomplete, regenerate it")
    actual = sha256_file(tensor_file)
    if actual != manifest.get("tensors_sha256"):
        raise GoldenError(f"{tensor_file}: sha256 {actual[:12]}… does not match the manifest's "
                          f"{str(manifest.get('tensors_sha256'))[:12]}…: the golden is corrupted or was "
                          "edited; regenerate it with `gemma-parity reference`")
    if expected_spec is not None and manifest.get("spec_hash") != expected_spec.spec_hash():
        raise GoldenError(
            f"{manifest_file}: golden was made for spec {manifest.get('spec_hash')}, but the checkpoint "
            f"resolves to spec {expected_spec.spec_hash()} ({expected_spec.source}). A golden only "
            "compares against the same model architecture; regenerate it for this config."
        )
    return Golden(path, manifest, load_file(str(tensor_file)))


@dataclass
class GoldenWritten:
    path: Path
    prompts: list[list[int]]
    new_tokens: int
    tokens: list[list[int]]  # the fp32 reference's greedy tokens per prompt


def make_golden(checkpoint_dir, out, prompts_path=None, new_tokens: int = 8, stream: bool = False,
                overwrite: bool = False, progress: bool = False) -> GoldenWritten:
    """Run the fp32 and bf16 references for the prompts and write them as a golden at `out`.

    `stream` computes the prefill captures one decoder layer at a time from the shards (peak memory
    about the embeddings plus one layer) and decodes nothing."""
    from harness.checkpoint import Checkpoint
    from harness.prompts import load_prompts, validate_prompt_ids
    from harness.reference import run_reference, stream_prefill_captures_many

    ckpt = Checkpoint.open(checkpoint_dir)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise GoldenError(f"{out}: already exists; choose a new --out or pass --overwrite")
    prompts = load_prompts(prompts_path, checkpoint_dir)
    validate_prompt_ids(ckpt.spec, prompts, prompts_path)
    ckpt.check_finite()
    if stream:  # one pass over the weights per dtype, all prompts at once
        results = {dtype: [ReferenceResult(p, dtype, captures, [], torch.empty(0, ckpt.spec.vocab_size))
                           for p, captures in zip(prompts, stream_prefill_captures_many(ckpt, prompts, dtype, progress))]
                   for dtype in ("float32", "bfloat16")}
        new_tokens = 0
    else:
        results = run_reference(checkpoint_dir, prompts, new_tokens, progress=progress)
    write_golden(out, ckpt.spec, results, new_tokens, ckpt.file_hashes(), str(checkpoint_dir), overwrite=overwrite)
    return GoldenWritten(out, prompts, new_tokens, [r.generated for r in results["float32"]])
