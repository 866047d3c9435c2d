"""docs/verdicts.md's samples are real output (issue 49: the README's failing sample ended `PARITY FAIL
(stage fp32, bf16, served)` where a real run lists `bitwise_layers` and `batch` too). Each sample
block names the command that printed it; this test runs the command and compares structurally: with
numbers masked and spaces collapsed, every line of the sample appears in the run's output in the same
order (a sample may cut lines, never invent or reorder them), and the verdict lines at the end (what
failed, SEQ_MATCH, PARITY with its list of stages) are the run's own, numbers and all.

Slow lane: two whole checks of the tiny model (about 45 s each on an idle 2-core machine)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from harness.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "verdicts.md"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]\d+)?")
SAMPLE = re.compile(r"<!-- sample: (\S+) -->\n```text\n(.*?)\n```", re.S)
VERDICT_LINES = ("first divergent layer", "SEQ_MATCH", "first failure", "PARITY")


def samples() -> dict[str, list[str]]:
    return {name: block.splitlines() for name, block in SAMPLE.findall(DOC.read_text())}


def run(name: str) -> tuple[int, list[str]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if name == "healthy":
            code = cli(["check"])
        else:
            from tests.faults.check_with import main as check_with

            code = check_with([name])
    return code, out.getvalue().splitlines()


def shape(line: str) -> str:
    return " ".join(NUMBER.sub("#", line).split())


def is_subsequence(sample: list[str], output: list[str]) -> tuple[bool, str]:
    lines = iter(shape(line) for line in output)
    for line in sample:
        if line.strip() in ("...", ""):
            continue
        if not any(shape(line) == got for got in lines):
            return False, line
    return True, ""


def test_the_doc_has_a_healthy_and_a_failing_sample():
    found = samples()
    assert set(found) == {"healthy", "window-one-too-wide"}
    assert found["healthy"][-1] == "PARITY PASS"
    assert any(line.startswith("PARITY FAIL (stage ") for line in found["window-one-too-wide"])


@pytest.mark.slow
@pytest.mark.parametrize("name, status", [("healthy", 0), ("window-one-too-wide", 1)])
def test_each_sample_is_what_its_command_prints(name, status):
    code, output = run(name)
    assert code == status
    sample = samples()[name]
    ok, missing = is_subsequence(sample, output)
    assert ok, f"docs/verdicts.md's {name} sample has a line the run did not print in that order: {missing!r}"
    tail = [shape(line) for line in sample if line.startswith(VERDICT_LINES)]
    assert tail == [shape(line) for line in output if line.startswith(VERDICT_LINES)][-len(tail):]
    parity = [line for line in output if line.startswith("PARITY")]
    assert [line for line in sample if line.startswith("PARITY")] == parity[-1:]  # every stage that failed


def test_the_structural_comparison_catches_a_stale_sample():
    """What the check above relies on: an invented or reordered line is caught, a cut is not."""
    output = ["port: x 1.0", "0 sliding 2.5e-03 pass", "5 full 3.5e-03 FAIL", "PARITY FAIL (stage fp32, bf16, batch)"]
    assert is_subsequence(["port: x 7.0", "...", "5   full  9.9e-01  FAIL"], output)[0]  # numbers and spacing masked
    assert not is_subsequence(["5 full 3.5e-03 FAIL", "0 sliding 2.5e-03 pass"], output)[0]  # reordered
    assert not is_subsequence(["5 full 3.5e-03 pass"], output)[0]  # a verdict the run did not give
    assert not is_subsequence(["PARITY FAIL (stage fp32, bf16)"], output)[0]
