"""The leftovers of killed runs (the temps and claims harness/base/atomic.py names with the writer's
pid and host): found by name, a moved-aside old directory put back, anything else stale removed,
never a live run's."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

# read back by the names the writer gives them (harness/base/atomic.py)
from harness.base.atomic import _HOST, _OLD_TARGET, CLAIM_SUFFIX, TEMP_MARK

STALE_AFTER_S = 24 * 3600  # a temp whose writer cannot be checked (another host) is stale after this
PID_REUSED_AFTER_S = 7 * 24 * 3600
_OWNER = re.compile(r"\.(?P<pid>\d+)@(?P<host>[0-9a-f]{8})\.")


def _stale_claim(entry: Path) -> bool:
    """A claim file nobody holds (its run was killed): taking the lock without waiting proves it."""
    import fcntl

    try:
        fd = os.open(entry, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def is_stale(entry: Path, now: float | None = None, max_age_s: float = STALE_AFTER_S) -> bool:
    """A temp of this tool (its name carries the writer's pid and host) whose writer is gone: a dead
    pid on this host, or older than max_age_s from another host (which cannot be asked). A live
    run's temp is never stale, and a name without the writer's tag is never this tool's."""
    if not entry.name.startswith(TEMP_MARK):
        return False
    try:
        age = (now or time.time()) - entry.lstat().st_mtime
    except OSError:
        return False
    owner = _OWNER.search(entry.name[len(TEMP_MARK):])
    if owner is None:
        return False  # not named by this tool (a user's file that happens to start the same way)
    if owner["host"] == _HOST:
        pid = int(owner["pid"])
        # a week-old temp of a "live" pid is a reused pid, not a run
        return pid != os.getpid() and (not _pid_alive(pid) or age > PID_REUSED_AFTER_S)
    return age > max_age_s


def _restore_or_remove(entry: Path) -> str:
    """A moved-aside old directory whose target is missing (a kill between the two renames) is
    put back; anything else stale is removed."""
    target_file, previous = entry / _OLD_TARGET, entry / "previous"
    if entry.is_dir() and target_file.is_file() and previous.is_dir():
        target = entry.parent / target_file.read_text().strip()
        if target.parent == entry.parent and not target.exists():
            os.replace(previous, target)
            shutil.rmtree(entry, ignore_errors=True)
            return f"restored {target} (a run was killed while replacing it)"
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)
    return f"removed {entry} (left by a killed run)"


def clean_stale_temps(directory) -> list[str]:
    """Remove (or restore) the stale temps of killed runs in `directory`; what was done, per entry.
    Best effort: a directory that cannot be listed or an entry that cannot be removed is skipped."""
    directory = Path(directory)
    try:
        entries = [e for e in directory.iterdir() if e.name.startswith(TEMP_MARK)]
    except OSError:
        return []
    done = []
    for entry in entries:
        if entry.name.endswith(CLAIM_SUFFIX) and entry.is_file() and _stale_claim(entry):
            entry.unlink(missing_ok=True)
            continue
        if is_stale(entry):
            try:
                done.append(_restore_or_remove(entry))
            except OSError:
                continue
    return done
