"""Output directories this tool owns (`check --report`, `bisect --report`, `quality --report`):
written as a whole, replaced only when every file in them is one this tool wrote.

Each such directory carries MANIFEST: the sha256 of every file written into it. It is built beside
its target and swapped in at once (harness/base/atomic.atomic_directory), so an interrupted run (Ctrl-C,
SIGTERM, a kill) leaves the old directory or the new one, never new files beside old ones. An
existing directory may be replaced only when it is empty, or when its manifest names exactly the
files it holds with the hashes they have: a file added, removed or edited by hand stops the run
before any model work (the user's data is never replaced). docs/ci.md#owned-outputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from harness.base.atomic import atomic_directory, write_json_atomic
from harness.base.errors import OutputError

MANIFEST = ".gemma-parity-manifest.json"
MAX_MANIFEST_BYTES = 1 << 20


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_manifest(directory: Path) -> dict | None:
    """The manifest's {name: sha256}, or None when it is absent, unreadable or not one of ours."""
    file = directory / MANIFEST
    try:
        if not file.is_file() or file.is_symlink() or file.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        data = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("written_by") == "gemma-parity" else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return None
    return files


def foreign_entries(directory) -> list[str]:
    """Entries of `directory` this tool did not write (or that changed since): empty when the
    directory may be replaced as a whole. A missing or empty directory has none."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    entries = sorted(p for p in directory.iterdir() if p.name != MANIFEST)
    if not entries:
        return []
    files = _read_manifest(directory)
    if files is None:
        return [p.name for p in entries]
    foreign = []
    for p in entries:
        try:
            ours = p.is_file() and not p.is_symlink() and files.get(p.name) == _sha256(p)
        except OSError:
            ours = False
        if not ours:
            foreign.append(p.name)
    return foreign


def refuse_foreign(directory, flag: str, command: str) -> None:
    """Exit 2 (OutputError) when `directory` holds anything this tool did not write."""
    foreign = foreign_entries(directory)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise OutputError(f"{flag} {directory}: holds files that are not part of a gemma-parity report "
                          f"({', '.join(foreign[:5])}{more}): gemma-parity {command} did not write them, or they "
                          "changed since; choose a new or empty directory, or move them away yourself")


def write_manifest(directory: Path) -> None:
    files = {p.name: _sha256(p) for p in sorted(Path(directory).iterdir()) if p.is_file() and p.name != MANIFEST}
    write_json_atomic(Path(directory) / MANIFEST, {"written_by": "gemma-parity", "files": files})


@contextlib.contextmanager
def owned_directory(out_dir, flag: str, command: str):
    """Yield a temp directory to fill; on success it replaces `out_dir` at once, with a manifest.
    Checked again here (not only before the model work): the directory may have changed since."""
    refuse_foreign(out_dir, flag, command)
    with atomic_directory(out_dir, replace=True) as tmp:
        yield tmp
        write_manifest(tmp)
