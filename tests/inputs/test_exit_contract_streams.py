"""The exit contract when the streams or the user are hostile: a refusal written to a closed stderr
still exits 2 (not 1, the parity-failure code), and Ctrl-C while `python -m harness.cli` is still
importing exits 130 with one line and no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.inputs.scenarios import REPO, cli_env


def test_bad_input_with_stderr_a_closed_pipe_exits_2():
    read, write = os.pipe()
    os.close(read)  # `... 2>&1 | head -c0`: nobody reads what the refusal writes
    try:
        proc = subprocess.run([sys.executable, "-m", "harness.cli", "check", "--model", "tiny", "--tp", "3"],
                              stdout=subprocess.DEVNULL, stderr=write, env=cli_env(), cwd=REPO, timeout=600)
    finally:
        os.close(write)
    assert proc.returncode == 2


def test_ctrl_c_while_starting_exits_130_with_one_line():
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "check", "--model", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(), cwd=REPO, text=True)
    time.sleep(1.0)  # the interpreter is up; the commands (torch) are still importing, or running
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and err.count("\n") == 1, err
