"""Atomic writes: every file and directory the harness writes appears whole or not at all.

One recipe for all of them: write into a temporary name in the same directory (same filesystem),
fsync, then rename over the target. `no_clobber` refuses to replace an existing target (goldens,
baselines, history entries are never overwritten silently); for files it is enforced atomically
with a hard link where the filesystem has them. A directory is replaced by an atomic exchange
(renameat2 RENAME_EXCHANGE) where the kernel has it, so the old one stays in place until the new
one is; elsewhere the old one is moved aside first and put back by the next run if a kill came
in between.

Temp names start with TEMP_MARK and carry the writer's pid and host, so the leftovers of a killed
run are recognisable and `clean_stale_temps` (harness/base/leftovers.py) removes them on a later
run (never a live run's).
OSErrors become OutputError naming the user's path, never the temp name.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

from harness.base.errors import SHOW_BYTES, HarnessInputError, OutputError, os_problem

TEMP_MARK = ".partial-"  # temp names start with this, so leftovers of a killed run are recognisable
FILE_MODE = 0o644  # what a user's umask normally gives; mkstemp alone would leave 0600
DIR_MODE = 0o755
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_OLD_TARGET = "TARGET"  # inside a moved-aside old directory: the name it came from


def _exists_error(path: Path) -> HarnessInputError:
    return HarnessInputError(f"{path}: already exists and is never overwritten silently; choose "
                             "another name or pass the command's overwrite flag deliberately")


def _apply_umask(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def temp_prefix(name: str, kind: str = "") -> str:
    """`.partial-<name>.<kind><pid>@<host>.`: the writer is part of the name (names cut to fit)."""
    return f"{TEMP_MARK}{name[:80]}.{kind}{os.getpid()}@{_HOST}."


def _refuse_wrong_kind(path: Path, want_dir: bool) -> None:
    if want_dir and path.exists() and not path.is_dir():
        raise OutputError(f"{path}: exists and is not a directory; give a directory path (or a new name)")
    if not want_dir and path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file path")
    if not want_dir and path.exists() and not path.is_file():
        raise OutputError(f"{path}: exists and is not a regular file (a device, pipe or socket); "
                          "give a regular file path")


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{path}: a part of the path is a file, not a directory; fix the path") from None
    except OSError as exc:
        raise OutputError(os_problem(exc, path)) from None


def write_bytes_atomic(path, data: bytes, no_clobber: bool = False) -> Path:
    """Write `data` to `path` atomically (temp file beside it, fsync, rename)."""
    path = Path(path)
    _refuse_wrong_kind(path, want_dir=False)
    _make_parent(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _apply_umask(FILE_MODE))
        if no_clobber:
            _link_no_clobber(Path(tmp), path)
        else:
            os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(os_problem(exc, path)) from None
    finally:
        if tmp and os.path.lexists(tmp):
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
    # a path with bytes that are not UTF-8 (argv decoded with surrogateescape) is written as \xNN
    return write_bytes_atomic(path, text.encode("utf-8", SHOW_BYTES), no_clobber=no_clobber)


def write_json_atomic(path, payload, no_clobber: bool = False, indent: int = 2,
                      sort_keys: bool = False) -> Path:
    text = json.dumps(payload, indent=indent, sort_keys=sort_keys, default=str) + "\n"
    return write_text_atomic(path, text, no_clobber=no_clobber)


@contextmanager
def atomic_directory(out_dir, replace: bool = False, final: bool = False):
    """Yield a temp directory beside `out_dir`; on success it is renamed to `out_dir`.

    `final`: the command's own result (a golden): from its rename on, a signal no longer unwinds the
    run (harness/base/commit_point.py), so an output put in place is never reported as interrupted.

    With `replace`, an existing `out_dir` is swapped out only once the new one is complete (an
    atomic exchange, or move aside then rename in), so a kill at any point leaves the old or the
    new directory whole. Without it, an existing non-empty `out_dir` is an error. On any failure
    the temp directory is removed and `out_dir` is untouched. The caller decides whether an
    existing directory may be replaced at all (only one this tool wrote: see harness.reference.golden).
    """
    out_dir = Path(out_dir)
    _refuse_wrong_kind(out_dir, want_dir=True)
    _make_parent(out_dir)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir.name), dir=out_dir.parent))
    except OSError as exc:
        raise OutputError(os_problem(exc, out_dir)) from None
    try:
        os.chmod(tmp, _apply_umask(DIR_MODE))
        yield tmp
        if final:
            from harness.base.commit_point import committing

            committing()
        _rename_into_place(tmp, out_dir, replace)
    except OSError as exc:
        raise OutputError(os_problem(exc, out_dir)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _normal_modes(tmp: Path) -> None:
    """What a user's umask gives: some writers (safetensors) create files 0600."""
    for path in tmp.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, _apply_umask(DIR_MODE if path.is_dir() else FILE_MODE))


def _rename_into_place(tmp: Path, out_dir: Path, replace: bool) -> None:
    _normal_modes(tmp)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        if not replace:
            raise _exists_error(out_dir)
        if _exchange(tmp, out_dir):
            return  # tmp now holds the old directory; the caller's cleanup removes it
        old = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir.name, "old."), dir=out_dir.parent))
        (old / _OLD_TARGET).write_text(out_dir.name)
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


# ---- claiming a new output before the work that fills it --------------------------------------

CLAIM_SUFFIX = ".claim"
_claims: list[tuple[int, Path]] = []  # this process's claims: (locked fd, claim file)


def _claim_file(path: Path) -> Path:
    return path.parent / f"{TEMP_MARK}{path.name[:80]}{CLAIM_SUFFIX}"


def claim_output(path: Path, flag: str) -> None:
    """Claim the new output `path` for this run, before its model work: a second run asking for
    the same output is refused at once (exit 2) instead of losing the race at its final rename,
    minutes later. The claim is an exclusive lock on a file beside the output, which the kernel
    drops when the process ends (a killed run leaves no live claim); release_claims removes it.
    Nothing is claimed where the parent directory does not exist yet (nothing is created to
    claim it)."""
    import fcntl

    claim = _claim_file(path)
    if not path.parent.is_dir():
        return
    for _ in range(3):  # the claim file may be removed between our open and our lock: retry
        try:
            fd = os.open(claim, os.O_RDWR | os.O_CREAT, _apply_umask(FILE_MODE))
        except OSError as exc:
            raise OutputError(f"{flag} " + os_problem(exc, path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{flag} {path}: another gemma-parity run is writing it right now; wait for it "
                              "to finish, or choose another location") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(claim).st_ino
        except FileNotFoundError:
            same = False
        if same:
            _claims.append((fd, claim))
            return
        os.close(fd)
    raise OutputError(f"{flag} {path}: cannot claim it (other runs keep taking it); try again")


def release_claims() -> None:
    """Remove this process's claims (while still holding them, so no other run holds a removed one)."""
    while _claims:
        fd, claim = _claims.pop()
        try:
            os.unlink(claim)
        except OSError:
            pass
        os.close(fd)
