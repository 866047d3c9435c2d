"""Atomic writes: every file and directory the harness writes appears whole or not at all.

One recipe for all of them: write into a temporary name in the same directory (same filesystem),
fsync, then rename over the target. `no_clobber` refuses to replace an existing target (goldens,
baselines, history entries are never overwritten silently); for files it is enforced atomically
with a hard link where the filesystem has them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from harness.errors import HarnessInputError

TEMP_MARK = ".partial-"  # temp names start with this, so leftovers of a killed run are recognisable
FILE_MODE = 0o644  # what a user's umask normally gives; mkstemp alone would leave 0600
DIR_MODE = 0o755


def _exists_error(path: Path) -> HarnessInputError:
    return HarnessInputError(f"{path}: already exists and is never overwritten silently; choose "
                             "another name or pass the command's overwrite flag deliberately")


def _apply_umask(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_bytes_atomic(path, data: bytes, no_clobber: bool = False) -> Path:
    """Write `data` to `path` atomically (temp file beside it, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_MARK}{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _apply_umask(FILE_MODE))
        if no_clobber:
            _link_no_clobber(Path(tmp), path)
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _link_no_clobber(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise _exists_error(path) from None
    except OSError:  # a filesystem without hard links: check, then rename
        if path.exists():
            raise _exists_error(path) from None
        os.replace(tmp, path)


def write_text_atomic(path, text: str, no_clobber: bool = False) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), no_clobber=no_clobber)


def write_json_atomic(path, payload, no_clobber: bool = False, indent: int = 2,
                      sort_keys: bool = False) -> Path:
    text = json.dumps(payload, indent=indent, sort_keys=sort_keys, default=str) + "\n"
    return write_text_atomic(path, text, no_clobber=no_clobber)


@contextmanager
def atomic_directory(out_dir, replace: bool = False):
    """Yield a temp directory beside `out_dir`; on success it is renamed to `out_dir`.

    With `replace`, an existing `out_dir` is swapped out only after the new one is complete (the
    old one is moved aside, the new one renamed in, then the old one removed), so a kill at any
    point leaves one whole directory. Without it, an existing non-empty `out_dir` is an error. On
    any failure the temp directory is removed and `out_dir` is untouched.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_MARK}{out_dir.name}.", dir=out_dir.parent))
    try:
        os.chmod(tmp, _apply_umask(DIR_MODE))
        yield tmp
        _rename_into_place(tmp, out_dir, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rename_into_place(tmp: Path, out_dir: Path, replace: bool) -> None:
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        if not replace:
            raise _exists_error(out_dir)
        old = Path(tempfile.mkdtemp(prefix=f"{TEMP_MARK}{out_dir.name}.old.", dir=out_dir.parent))
        os.replace(out_dir, old / "previous")
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            os.replace(old / "previous", out_dir)  # put the old one back
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
        return
    if out_dir.is_dir():
        out_dir.rmdir()  # empty: rename cannot replace a directory that exists
    os.replace(tmp, out_dir)
