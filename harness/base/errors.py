"""Errors for bad input: each names the file, key or value and says what to do (CLI exit 2).

Every class here is a `HarnessInputError`: the command line maps all of them to exit status 2 (bad
input or an environment problem), never to 1, which means "parity fails" and nothing else.
"""

import codecs as _codecs
import re as _re
import errno as _errno


class HarnessInputError(ValueError):
    """Bad input from the user: a config, checkpoint, golden, prompt or option the harness refuses."""


class ConfigError(HarnessInputError):
    """config.json is missing, of the wrong model_type, or asks for a feature the port lacks."""


class CheckpointError(HarnessInputError):
    """A checkpoint directory is missing shards or keys, has wrong shapes, or is a pickle."""


class GoldenError(HarnessInputError):
    """A golden is corrupted, incomplete, or was made for another spec."""


class PromptError(HarnessInputError):
    """A prompt is empty, has ids outside the vocabulary, or is longer than the largest bucket."""


class ShardingError(HarnessInputError):
    """A head layout cannot be split across the requested tensor parallel degree."""


class NumericsError(HarnessInputError):
    """NaN or Inf found in weights or activations."""


class OptionError(HarnessInputError):
    """A command-line value out of range, not finite, or in conflict with another option."""


class InputFileError(HarnessInputError):
    """An input file or directory cannot be read: missing, the wrong kind, unreadable, not UTF-8."""


class OutputError(HarnessInputError):
    """An output location cannot be written: the wrong kind, an input, not writable, disk full."""


def _show_undecodable(exc: UnicodeError):
    """Encoding error handler: a byte Python could not decode from a path or argument (kept as a
    lone surrogate by surrogateescape) is shown as \\xNN, so a message, a crash file or a report
    naming a non-UTF-8 path can always be written, and says which byte it was."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    chunk = exc.object[exc.start:exc.end]
    return "".join(f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"\\u{ord(c):04x}"
                   for c in chunk), exc.end


SHOW_BYTES = "gemma-parity-show-bytes"  # the error handler's name: str.encode("utf-8", SHOW_BYTES)
_codecs.register_error(SHOW_BYTES, _show_undecodable)


_ADVICE = {
    _errno.ENOSPC: "the disk is full: free some space or choose a location on another disk",
    _errno.EDQUOT: "the disk quota is exceeded: free some space or choose another location",
    _errno.EACCES: "permission denied: choose a location you may write to, or fix its permissions",
    _errno.EPERM: "permission denied: choose a location you may write to, or fix its permissions",
    _errno.EROFS: "the file system is read-only: choose a writable location",
    _errno.EISDIR: "it is a directory: give a file path",
    _errno.ENOTDIR: "a part of the path is a file, not a directory: fix the path",
    _errno.ENAMETOOLONG: "the name is too long: choose a shorter path",
    _errno.ENOENT: "a directory on the path does not exist or was removed during the run",
}


def os_problem(exc: OSError, path, action: str = "cannot write") -> str:
    """One sentence for an OSError about the user's `path` (never a temp name, never `None`)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    advice = _ADVICE.get(exc.errno)
    return f"{path}: {action} ({reason})" + (f": {advice}" if advice else "; check the location and run again")


def wrapped_os_error(exc: BaseException) -> OSError | None:
    """The OSError inside another library's exception: safetensors (Rust) reports a full disk as
    SafetensorError("... I/O error: No space left on device (os error 28)")."""
    import os
    import re

    if isinstance(exc, OSError):
        return exc
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def not_a_file(path) -> str:
    """Why `path` is not a regular file to read, in a few words: "not found", "is a directory",
    "is a named pipe", ... (never "missing" for something that is there but of the wrong kind)."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "dangling symbolic link" if os.path.islink(path) else "not found"
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    kinds = ((stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a named pipe"), (stat.S_ISCHR, "is a character device"),
             (stat.S_ISBLK, "is a block device"), (stat.S_ISSOCK, "is a socket"))
    return next((what for test, what in kinds if test(mode)), "is not a regular file")


def read_problem(exc: OSError, path, what: str = "file") -> str:
    """One sentence for an OSError met while reading the user's input `path`."""
    if exc.errno in (_errno.EACCES, _errno.EPERM):
        return f"{path}: cannot read the {what}: permission denied; fix its permissions or copy it somewhere readable"
    if exc.errno == _errno.EISDIR:
        return f"{path}: is a directory; give the {what} itself"
    if exc.errno == _errno.ENOENT:
        return f"{path}: {what} not found; check the path"
    return f"{path}: cannot read the {what} ({exc.strerror or exc})"


MAX_JSON_DEPTH = 200  # far beyond any file this tool reads; deeper nesting is refused, not recursed into


_JSON_STRING = _re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = _re.compile(r"[\[\]{}]")


def _depth_problem(text: str) -> int | None:
    """The offset where brackets nest deeper than MAX_JSON_DEPTH (outside strings), or None.
    Checked before parsing: the json module recurses once per level and a deep enough file
    exhausts Python's stack (RecursionError), which no caller should have to expect."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return None  # too few brackets to nest that deep: no scan needed
    blanked = _JSON_STRING.sub(lambda m: " " * len(m.group()), text)  # brackets inside strings do not nest
    depth = 0
    for found in _BRACKET.finditer(blanked):
        depth += 1 if found.group() in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            return found.start()
    return None


def parse_json_text(text: str, source, error: type[HarnessInputError], fix: str):
    """JSON from `text` (read from `source`), or `error`: invalid, nested too deeply, or holding
    an integer too long to convert. The one JSON parser for users' files."""
    import json

    offset = _depth_problem(text)
    if offset is not None:
        raise error(f"{source}: JSON nested more than {MAX_JSON_DEPTH} levels deep (at character {offset}); "
                    f"{fix}")
    try:
        return json.loads(text)
    except RecursionError:  # belt and braces: the scan above should have refused it
        raise error(f"{source}: JSON nested too deeply; {fix}") from None
    except ValueError as exc:  # JSONDecodeError, and integers beyond Python's digit limit
        raise error(f"{source}: not valid JSON ({exc}); {fix}") from None


def read_json_file(path, what: str, error: type[HarnessInputError], fix: str, encoding: str = "utf-8"):
    """The JSON in the user's file `path`, or one clear error: unreadable (InputFileError), not
    text in `encoding`, nested too deeply or not JSON (`error`, ending with `fix`). Every JSON file
    a user hands the tool is read through here."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputFileError(read_problem(exc, path, what)) from None
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); {fix}") from None
    return parse_json_text(text, path, error, fix)
