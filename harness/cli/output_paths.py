"""Where a command may write (the output step of harness/cli/validate.py's pass): an output path of
the right kind, writable, apart from every input and other output; an existing file or directory
replaced only when this tool wrote it; what killed runs left beside the outputs removed first."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from harness.base.atomic import temp_prefix
from harness.base.errors import HarnessInputError, OptionError, OutputError, os_problem, read_json_file
from harness.base.leftovers import clean_stale_temps

GENERATOR = "gemma-parity"  # the "generator" key of every JSON result the commands write
MARKDOWN_MARK = "<!-- written by gemma-parity -->"
# Keys that identify a JSON result written by an older gemma-parity (before the generator key).
LEGACY_RESULT_KEYS = ({"passed", "seq_match", "layers"}, {"mode", "layers"}, {"layers", "bytes_per_rank"},
                      {"baseline_label", "current_label", "metrics", "budgets"})


def _relation(out: Path, inp: Path) -> str | None:
    if out == inp:
        return "is"
    if inp in out.parents:
        return "is inside"
    if out in inp.parents:
        return "contains"
    return None


def _nearest_existing(path: Path) -> Path:
    for candidate in [path, *path.parents]:
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path(".")


def _probe_writable(path: Path, flag: str) -> None:
    """The directory the output goes into (or its nearest existing ancestor) takes a new file."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise OutputError(f"{flag} {path}: {base} is a file, not a directory; fix the path")
    try:
        with tempfile.NamedTemporaryFile(prefix=temp_prefix("probe"), dir=base):
            pass
    except OSError as exc:
        raise OutputError(f"{flag} " + os_problem(exc, path)) from None


def output_location(value: str, flag: str, want_dir: bool, inputs: dict[str, Path],
                    outputs: dict[str, Path]) -> Path:
    """An output path of the right kind, writable, neither an input nor inside or around one, nor
    overlapping another output. Returns it; the caller checks what may be replaced there."""
    if not value or not value.strip():
        raise OptionError(f"{flag}: empty path; give a {'directory' if want_dir else 'file'} path")
    path = Path(value)
    if len(os.fsencode(path.name)) > 255:
        raise OutputError(f"{flag} {path}: the name is longer than 255 bytes; choose a shorter name")
    if path.is_symlink():
        raise OutputError(f"{flag} {path}: is a symbolic link; give the real path (nothing is written "
                          "through links, so a link cannot redirect an overwrite)")
    if want_dir and path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path}: exists and is not a directory; give a directory path")
    if not want_dir and path.is_dir():
        raise OutputError(f"{flag} {path}: is a directory; give a file path")
    if not want_dir and path.exists() and not path.is_file():
        raise OutputError(f"{flag} {path}: exists and is not a regular file; give a regular file path")
    resolved = path.resolve()
    for label, inp in {**inputs, **outputs}.items():
        relation = _relation(resolved, inp.resolve())
        if relation:
            kind = "an output of this run too" if label in outputs else "an input of this run"
            raise OutputError(f"{flag} {path}: {relation} {label} {inp} ({kind}); writing there could "
                              "destroy it. Choose a location outside it.")
    _probe_writable(path, flag)
    outputs[flag] = path
    return path


def json_dict_or_none(path: Path) -> dict | None:
    """The JSON object a file at `path` holds, or None (no such file, not JSON, not an object): what
    decides whether an output may replace it."""
    if not path.is_file():
        return None
    try:
        data = read_json_file(path, "file", HarnessInputError, "")
    except HarnessInputError:
        return None
    return data if isinstance(data, dict) else None


def _json_is_ours(path: Path) -> bool:
    data = json_dict_or_none(path)
    if data is None:
        return False
    return str(data.get("generator", "")).startswith(GENERATOR) or any(keys <= data.keys()
                                                                       for keys in LEGACY_RESULT_KEYS)


def _markdown_is_ours(path: Path) -> bool:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return False
    return MARKDOWN_MARK in text or text.startswith(("### ✅", "### ❌"))


def replaceable_file(path: Path, flag: str, ours) -> None:
    """An existing file is replaced only when this tool wrote it (a result it rewrites each run)."""
    if path.exists() and not ours(path):
        raise OutputError(f"{flag} {path}: exists and was not written by gemma-parity; it is never "
                          "overwritten. Choose a new name, or move the file away yourself.")


def replaceable_report(path: Path, flag: str, command: str = "") -> None:
    """Only a directory this tool wrote (its manifest matches every file) may be replaced."""
    from harness.base.owned_dir import refuse_foreign

    refuse_foreign(path, flag, command)


def clean_leftovers(paths) -> None:
    """Remove what killed runs left beside (or in) the outputs and in the tiny-model cache."""
    from harness.base.errors import OutputError
    from harness.inputs.tiny import cache_dir

    try:
        cache = {cache_dir()}
    except OutputError:  # no home and no GEMMA_PARITY_CACHE: no cache to clean (a command needing one says so)
        cache = set()
    dirs = {p.parent for p in paths} | {p for p in paths if p.is_dir()} | cache
    for directory in sorted(dirs):
        for line in clean_stale_temps(directory):
            print(f"gemma-parity: {line}", file=sys.stderr)
