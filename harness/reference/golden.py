"""Golden files: reference tensors in safetensors plus a JSON manifest with hashes and provenance.

A golden directory holds `manifest.json` and `tensors.safetensors`. It is written into a temp
directory and renamed into place (nothing half written), never over an existing golden unless asked
(and never over a directory that is not a golden): harness/reference/golden_write.py. Both are
sealed as snapshots are (harness/inputs/sealed.py: one hash over the manifest and the tensors).
Reading (here) verifies the seal, that the golden was made for the expected spec, that its
prompts, tokens and tensor shapes agree, and that every value is finite.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.base.errors import GoldenError, HarnessInputError, read_json_file
from harness.inputs.sealed import SealedFormat
from harness.reference.golden_layout import (check_no_stray_tensors, check_prompt_tensors, check_same_groups, check_tokens,
                                             inconsistent)
from harness.reference.run import ReferenceResult

# Sealed as a snapshot is (harness/inputs/sealed.py); format 2: the manifest is covered by the seal.
GOLDEN = SealedFormat("golden", "manifest.json", "tensors.safetensors", seal_key="golden_sha256", version=2,
                      error=GoldenError, source="a directory written by `gemma-parity reference`",
                      fix="regenerate it with `gemma-parity reference`")
MANIFEST, TENSORS = GOLDEN.files
DTYPES = ("float32", "bfloat16")


def is_golden_dir(path: Path) -> bool:
    """A directory this tool wrote as a golden: its manifest is a golden manifest."""
    file = Path(path) / MANIFEST
    if not file.is_file():  # a pipe or device called manifest.json would block or never end
        return False
    try:
        manifest = read_json_file(file, "golden manifest", GoldenError, "")
    except HarnessInputError:
        return False
    return isinstance(manifest, dict) and "format_version" in manifest and "tensors_sha256" in manifest


def _finite_or_refuse(tensors: dict[str, torch.Tensor], where) -> None:
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise GoldenError(f"{where}: {name} contains NaN or Inf; a reference with non-finite values "
                              "judges nothing. Check the checkpoint's weights and regenerate the golden.")


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
    """Read and verify a golden: hashes over manifest and tensors, the spec it was made for, its
    internal consistency (prompts, tokens and tensor shapes agree) and finite values."""
    path = Path(path)
    manifest = GOLDEN.read_manifest(path)
    tensor_file = GOLDEN.check_seal(path, manifest)
    if expected_spec is not None and manifest.get("spec_hash") != expected_spec.spec_hash():
        raise GoldenError(
            f"{path / MANIFEST}: golden was made for spec {manifest.get('spec_hash')}, but the checkpoint "
            f"resolves to spec {expected_spec.spec_hash()} ({expected_spec.source}). A golden only "
            "compares against the same model architecture; regenerate it for this config."
        )
    tensors = GOLDEN.load(tensor_file, manifest)
    _check_consistency(path, manifest, tensors, expected_spec)
    _finite_or_refuse(tensors, tensor_file)
    return Golden(path, manifest, tensors)


def _check_consistency(path: Path, manifest: dict, tensors: dict, spec) -> None:
    from harness.inputs.prompts import is_token_id

    prompts, new_tokens, results = manifest.get("prompts"), manifest.get("new_tokens"), manifest.get("results")
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompts):
        raise inconsistent(path, "prompts must be a non-empty list of non-empty token-id lists")
    if not is_token_id(new_tokens) or new_tokens < 0:
        raise inconsistent(path, f"new_tokens {new_tokens!r} is not a non-negative integer")
    if not isinstance(results, dict) or "float32" not in results or set(results) - set(DTYPES):
        raise inconsistent(path, "results must hold float32 (and bfloat16), nothing else")
    num_layers = manifest.get("num_layers")
    if not is_token_id(num_layers) or num_layers < 1 or (spec is not None and num_layers != spec.num_layers):
        raise inconsistent(path, f"num_layers {num_layers!r} is not the spec's layer count")
    accounted: set[str] = set()
    held: dict[str, frozenset[str]] = {}
    for dtype in sorted(results):
        runs = results[dtype]
        if not isinstance(runs, list) or len(runs) != len(prompts):
            raise inconsistent(path, f"results.{dtype} must have one entry per prompt ({len(prompts)})")
        for k, (prompt, run) in enumerate(zip(prompts, runs)):
            generated = run.get("generated") if isinstance(run, dict) else None
            vocab = spec.vocab_size if spec is not None else float("inf")
            if not isinstance(generated, list) or len(generated) != new_tokens or not all(
                    is_token_id(t) and 0 <= t < vocab for t in generated):
                raise inconsistent(path, f"results.{dtype}[{k}].generated must be {new_tokens} token ids")
            prefix = f"{dtype}.p{k}."
            seen, held[prefix.rstrip(".")] = check_prompt_tensors(path, tensors, prefix, len(prompt), new_tokens,
                                                                  num_layers, spec)
            accounted |= seen
            check_tokens(path, tensors, prefix, generated, f"results.{dtype}[{k}].generated")
    check_no_stray_tensors(path, tensors, accounted)
    check_same_groups(path, held)


def same_weights(golden: Golden, checkpoint) -> bool | None:
    """Whether the golden was written from these weights (their safetensors files' sha256); None
    when the golden records no checkpoint hashes. config.json is left out: the spec hash covers the
    architecture, and a reformatted config does not change a weight."""
    provenance = golden.manifest.get("checkpoint")
    recorded = provenance.get("files") if isinstance(provenance, dict) else None
    recorded = {k: v for k, v in recorded.items() if k != "config.json"} if isinstance(recorded, dict) else {}
    if not recorded:
        return None
    if hasattr(checkpoint, "weight_files") and set(recorded) != {f.name for f in checkpoint.weight_files()}:
        return False  # other shard files: no need to hash anything
    current = {k: v for k, v in checkpoint.file_hashes().items() if k != "config.json"}
    return recorded == current
