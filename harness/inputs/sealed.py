"""A sealed directory: one JSON manifest beside one safetensors file, the one mechanism goldens
(harness/reference/golden.py) and snapshots (harness/snapshot/) are written and read by.

The manifest carries the tensor file's sha256 and a seal: one sha256 over the manifest (without
the seal) and that file hash, so editing either is caught; a snapshot's manifest also lists each
tensor's own digest, dtype and shape (`tensor_entries`), so a tensor file edited and resealed is
caught too. Writing (`SealedFormat.write`, inside the caller's atomic directory): the tensors
saved, checked complete on disk, hashed, the manifest sealed and fsynced. Reading (`read_manifest`,
`check_seal`, `load`): every refusal, before any model work, is one line of the format's error naming
the file, what is wrong and what to do (the format's `fix`). The seal is unkeyed: what a manifest
says is checked by its reader (golden_layout.py, snapshot/fields.py)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from harness.base.errors import (InputFileError, OutputError, not_a_file, os_problem, read_json_file, read_problem,
                                 wrapped_os_error)
from harness.inputs.checkpoint import sha256_file


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype), with its dtype and shape."""
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    # flattened first: the same bytes, and a 0-d tensor (which cannot be viewed as bytes) digests too
    return hashlib.sha256(head + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def tensor_entries(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Each tensor's shape, dtype and digest, as a manifest lists them (checked by `load`)."""
    return {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sha256": tensor_digest(t)}
            for name, t in sorted(tensors.items())}


@dataclass(frozen=True)
class SealedFormat:
    """One kind of sealed directory: its files, its seal's key and version, and how it is refused."""

    what: str  # "golden", "snapshot": named in every refusal
    manifest: str  # the two files' names
    tensors: str
    seal_key: str  # the manifest key holding the seal
    version: int  # format_version this harness reads and writes
    error: type  # the refusal (a HarnessInputError: exit 2)
    source: str  # where a good one comes from ("a directory written by ...")
    fix: str  # what to do, ending every refusal
    kind: str | None = None  # the manifest's "kind", for a format that names itself
    indent: int = 2
    digests: bool = False  # the manifest lists each tensor (tensor_entries), checked by `load`

    @property
    def files(self) -> tuple[str, str]:
        return self.manifest, self.tensors

    def seal(self, manifest: dict, tensors_sha256: str) -> str:
        """sha256 over the manifest (without the seal) and the tensor file's sha256."""
        body = {k: v for k, v in manifest.items() if k != self.seal_key}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                              + tensors_sha256.encode()).hexdigest()

    # ---- writing ----------------------------------------------------------------------------------

    def write(self, tmp: Path, manifest: dict, tensors: dict[str, torch.Tensor], out_dir: Path) -> dict:
        """The tensors and the sealed manifest into `tmp` (the caller's atomic directory for
        `out_dir`, named in every error): the manifest as written."""
        try:
            save_file(tensors, str(tmp / self.tensors))
        except Exception as exc:  # safetensors raises its own error type for I/O failures
            os_error = wrapped_os_error(exc)
            raise OutputError(os_problem(os_error, out_dir) if os_error is not None else
                              f"{out_dir}: the {self.what}'s tensors could not be written ({exc})") from None
        self.verify_written(tmp / self.tensors, tensors, out_dir)
        manifest["tensors_sha256"] = sha256_file(tmp / self.tensors)
        manifest[self.seal_key] = self.seal(manifest, manifest["tensors_sha256"])
        with open(tmp / self.manifest, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=self.indent) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return manifest

    def verify_written(self, file: Path, tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
        """The tensor file holds every tensor and is as long as its header says (a write that lost
        data without an error, as on a full disk, is caught here rather than when it is read)."""
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
            with open(file, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                f.seek(0, os.SEEK_END)
                size = f.tell()
                os.fsync(f.fileno())
        except Exception as exc:
            if isinstance(exc, OSError):
                raise OutputError(os_problem(exc, out_dir)) from None
            raise OutputError(f"{out_dir}: the {self.what}'s tensors could not be written completely ({exc}); "
                              "check free disk space and write permission, then run again") from None
        data = sum(t.numel() * t.element_size() for t in tensors.values())
        if keys != set(tensors) or size != 8 + header_len + data:
            raise OutputError(f"{out_dir}: the {self.what}'s tensors were written incompletely ({size} bytes); "
                              "the disk may be full: free some space and run again")

    # ---- reading ----------------------------------------------------------------------------------

    def read_manifest(self, path: Path) -> dict:
        """The manifest of the directory `path`: a JSON object of this kind and version."""
        if not path.is_dir():
            what = not_a_file(path)  # what is there: not found, a file, a dangling link, a link loop, a pipe...
            raise self.error(f"{path}: {'not a directory' if what == 'is not a regular file' else what}; pass "
                             f"{self.source}")
        file = path / self.manifest
        if not file.is_file():
            what = not_a_file(file)
            raise self.error(f"{path}: no {self.manifest}, so not a {self.what}; pass {self.source}"
                             if what == "not found" else f"{file}: {what}, not the {self.what}'s manifest; {self.fix}")
        manifest = read_json_file(file, f"{self.what} manifest", self.error, self.fix)
        if not isinstance(manifest, dict) or (self.kind is not None and manifest.get("kind") != self.kind):
            named = f" (kind {self.kind!r})" if self.kind else " (a JSON object)"
            raise self.error(f"{file}: not a {self.what} manifest{named}; {self.fix}")
        if manifest.get("format_version") != self.version:
            raise self.error(f"{file}: format_version {manifest.get('format_version')!r}, this harness reads "
                             f"{self.version}; {self.fix}")
        return manifest

    def check_seal(self, path: Path, manifest: dict) -> Path:
        """The tensor file, once its sha256 is the manifest's and the seal holds."""
        file = path / self.tensors
        if not file.is_file():
            what = not_a_file(file)
            raise self.error(f"{file}: missing; the {self.what} is incomplete: {self.fix}" if what == "not found" else
                             f"{file}: {what}, not the {self.what}'s tensor file; the {self.what} is incomplete or "
                             f"damaged: {self.fix}")
        try:
            actual = sha256_file(file)
        except OSError as exc:
            raise InputFileError(read_problem(exc, file, f"{self.what} tensor file")) from None
        if actual != manifest.get("tensors_sha256"):
            raise self.error(f"{file}: sha256 {actual[:12]}… does not match the manifest's "
                             f"{str(manifest.get('tensors_sha256'))[:12]}…: truncated, corrupted or edited; {self.fix}")
        if manifest.get(self.seal_key) != self.seal(manifest, actual):
            raise self.error(f"{path / self.manifest}: its contents do not match its {self.seal_key}: the manifest "
                             f"was edited or corrupted; {self.fix}")
        return file

    def load(self, file: Path, manifest: dict) -> dict[str, torch.Tensor]:
        """The tensors of a file `check_seal` passed; for a format with `digests`, each tensor the one
        its manifest lists (names, shapes, digests): not edited and resealed."""
        try:
            tensors = load_file(str(file))
        except Exception as exc:
            raise self.error(f"{file}: cannot be read as safetensors ({exc}); {self.fix}") from None
        if not self.digests:
            return tensors
        entries = manifest.get("tensors")
        if not isinstance(entries, dict) or set(entries) != set(tensors):
            extra = sorted(set(tensors) ^ set(entries if isinstance(entries, dict) else {}))[:3]
            raise self.error(f"{file}: holds other tensors than its manifest lists ({', '.join(extra)}): resealed "
                             f"after an edit; {self.fix}")
        for name, t in tensors.items():
            entry = entries[name] if isinstance(entries[name], dict) else {}
            if list(t.shape) != entry.get("shape") or tensor_digest(t) != entry.get("sha256"):
                raise self.error(f"{file}: tensor {name} {list(t.shape)} is not the one recorded (shape "
                                 f"{entry.get('shape')}, sha256 {str(entry.get('sha256'))[:12]}…): the file was "
                                 f"edited and resealed; {self.fix}")
        return tensors
