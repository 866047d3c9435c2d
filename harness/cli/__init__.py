"""The `gemma-parity` command: info, reference, check, bisect, bench, perf compare, graphs, doctor and quality.

The top layer (docs/design.md#import-layers): argument parsing, printing and exit codes. Each command module adds its
subparser with a `validate` (the one validation pass, before any model work) and a `run` (one
library call); nothing in `harness` below this package imports it.

Exit status (the contract CI reads; see harness/cli/common.py and the README):
0 parity holds / no regression; 1 parity fails / a regression or broken budget, and nothing else;
2 bad input or an environment problem, with the path and the fix; 70 an internal error (a bug in
gemma-parity), with the traceback written to a file; 130 interrupted; 143 terminated.
"""

from __future__ import annotations

import sys

if sys.argv[:1] == ["-m"] and sys.orig_argv[len(sys.orig_argv) - len(sys.argv)] == "harness.cli":
    # `python -m harness.cli`: runpy imports this package before its __main__, so the signal guard
    # goes in here, before the commands import torch (a library import leaves signals alone)
    from harness.base.signal_guard import guard

    guard()

import argparse
import datetime
import os
import signal
import time
import tempfile
import traceback

from harness.cli import bisect, check, doctor, graphs, info, merge, perf, perf_compare, quality, reduce, reference, replay
from harness.cli.common import (EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK,  # noqa: F401
                                EXIT_PIPE, EXIT_TERMINATED)
from harness.base.atomic import release_claims
from harness.base.errors import SHOW_BYTES, HarnessInputError, os_problem

COMMANDS = (info, reference, check, bisect, perf, perf_compare, graphs, doctor, quality, merge, replay, reduce)


class Terminated(BaseException):
    """SIGTERM (a CI timeout, `kill`): unwind like Ctrl-C so temp files are removed on the way out."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gemma-parity",
        description="Gemma-4 12B on Inferentia2 (TP=2): run the port, prove parity with the CPU fp32 "
                    "reference layer by layer, bisect divergences, and watch performance. Exit status: "
                    "0 pass, 1 parity failure or regression, 2 bad input or environment, 70 internal "
                    "error, 130 interrupted.",
    )
    import harness

    parser.add_argument("--version", action="version", version=f"gemma-parity {harness.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_command(sub)
    return parser


def _command_name(args) -> str:
    return f"{args.command} {args.perf_command}" if getattr(args, "perf_command", None) else args.command


def _err(line: str) -> None:
    """One line to stderr; a closed stderr (`2>&1 | head -c0`) silences it instead of raising, so
    the exit status stays the one the contract gives."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # BrokenPipeError, or a stream already closed
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        except (OSError, ValueError):
            pass


def _on_sigterm(signum, frame):
    raise Terminated()


def _internal_error(name: str, exc: BaseException, argv: list[str]) -> int:
    """A bug, not a verdict: say so, keep the traceback, and never exit 1 (nor fail here: an
    argument that is not UTF-8 is written as \\xNN)."""
    text = "".join(traceback.format_exception(exc))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    where = None
    try:
        with tempfile.NamedTemporaryFile("w", prefix=f"gemma-parity-crash-{stamp}-", suffix=".txt",
                                         delete=False, encoding="utf-8", errors=SHOW_BYTES) as f:
            f.write(f"gemma-parity {name}: {' '.join(map(str, argv))}\n{text}")
            where = f.name
    except Exception:  # noqa: BLE001  (no crash file: the traceback goes to stderr below)
        pass
    _err(f"gemma-parity {name}: internal error (a bug in gemma-parity, not a parity verdict): "
         f"{type(exc).__name__}: {exc}")
    if where:
        _err(f"gemma-parity {name}: the traceback is in {where}; please report it with that file")
    else:
        _err(text.rstrip("\n"))
    return EXIT_INTERNAL


def _show_bytes_on_the_console() -> None:
    """Paths and arguments that are not UTF-8 print as \\xNN instead of raising mid-output."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors=SHOW_BYTES)
        except (AttributeError, ValueError, OSError):  # not a text stream we may reconfigure
            pass


def _run(args, name: str, argv: list[str]) -> int:
    from harness.cli.validate import refuse_nul

    status = None
    try:
        refuse_nul(args)
        args.validate(args)
        status = args.func(args)
        return status
    except HarnessInputError as exc:
        _err(f"gemma-parity {name}: error: {exc}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _err(f"gemma-parity {name}: interrupted; nothing half written was kept")
        return EXIT_INTERRUPTED
    except Terminated:
        _err(f"gemma-parity {name}: terminated; nothing half written was kept")
        return EXIT_TERMINATED
    except BrokenPipeError:
        # stdout closed early (`| head`): nothing more can be shown; not a parity verdict
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE  # quietly, as a tool killed by SIGPIPE: the reader asked for no more
    except OSError as exc:
        where = exc.filename if exc.filename is not None else "a file"
        _err(f"gemma-parity {name}: error: {os_problem(exc, where, 'failed')}")
        return EXIT_BAD_INPUT
    except MemoryError:
        _err(f"gemma-parity {name}: error: out of memory; use a machine with more memory (or, for "
             "`reference`, --stream)")
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001  (the contract: a bug is reported as one, never as exit 1)
        return _internal_error(name, exc, argv)
    finally:
        _after(name, status)


def _after(name: str, status: int | None) -> None:
    """Claims released; a signal held since the output's commit point (harness/base/commit_point.py)
    or arriving now, once the command returned, is reported and leaves its status alone."""
    from harness.base import commit_point

    late = []
    try:
        try:
            release_claims()
        except (KeyboardInterrupt, Terminated) as exc:
            if status is None:
                raise
            late.append(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
    finally:
        late = commit_point.finish() + late
        demo = sys.modules.get("harness.port.demo_fault")  # loaded only by a --demo-fault run
        if demo is not None:
            demo.unplant_all()  # a --demo-fault's bug ends with its command
    if late and status is not None:
        _err(f"gemma-parity {name}: {commit_point.signal_name(late[0])} came after the output was written whole; "
             f"the run finished (exit {status})")


def main(argv=None) -> int:
    _show_bytes_on_the_console()
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    parser = build_parser()
    args = parser.parse_args(argv)  # a malformed command line exits 2 (argparse)
    args.started = time.perf_counter()  # check --verbose: the command's time beside its run's
    previous = {signal.SIGTERM: signal.getsignal(signal.SIGTERM), signal.SIGINT: signal.getsignal(signal.SIGINT)}
    try:
        # from here a signal unwinds (temp files are removed on the way out): Ctrl-C as
        # KeyboardInterrupt, SIGTERM as Terminated (harness/entry.py guards the time before)
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from harness.base.commit_point import arm

        arm()
    except ValueError:  # not the main thread (a library caller's worker): leave signals alone
        previous = {}
    try:
        return _run(args, _command_name(args), argv)
    finally:
        from harness.backends.neuron_gate import LEDGER
        from harness.base.signal_guard import _exit_now

        LEDGER.state(None, "")  # the command's build budget ends with it (a library caller runs on)

        for signum, handler in previous.items():
            if handler is _exit_now:  # the console script, about to exit with the command's status:
                handler = signal.SIG_IGN  # a late signal must not say "interrupted while starting"
            if handler is not None:
                signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
