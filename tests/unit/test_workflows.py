"""The workflows a team copies (.github/workflows/): valid YAML with the structure GitHub Actions
needs (a trigger, jobs with a runner and steps, each step a `run` or a `uses`), and the lanes
docs/ci.md describes: the PR lane runs the smoke marker, the nightly runs the default, slow and XLA
lanes, the inf2 workflow writes the 12B golden on a CPU host, checks the device against it with a
report and JUnit, and keeps the perf history out of the evictable cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

WORKFLOWS = Path(__file__).resolve().parents[2] / ".github" / "workflows"


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def runs(workflow: dict) -> str:
    return "\n".join(step.get("run", "") for job in workflow["jobs"].values() for step in job["steps"])


@pytest.mark.parametrize("name", ["pr.yml", "nightly.yml", "inf2.yml"])
def test_workflow_has_the_structure_actions_needs(name):
    workflow = load(name)
    assert workflow.get(True) or workflow.get("on"), "a trigger (`on:`; YAML 1.1 reads the key as True)"
    assert workflow["jobs"]
    for job_name, job in workflow["jobs"].items():
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", job_name)
        assert job.get("runs-on"), job_name
        assert job["steps"], job_name
        for step in job["steps"]:
            assert ("run" in step) != ("uses" in step), (job_name, step)
        for need in [job["needs"]] if isinstance(job.get("needs"), str) else job.get("needs", []):
            assert need in workflow["jobs"], (job_name, need)


def test_the_pr_lane_runs_the_registered_smoke_marker():
    assert "pytest -m smoke" in runs(load("pr.yml"))
    pyproject = (WORKFLOWS.parents[1] / "pyproject.toml").read_text()
    assert '"smoke:' in pyproject


def test_the_nightly_runs_the_default_slow_and_xla_lanes():
    workflow = load("nightly.yml")
    lanes = {lane["name"] for lane in workflow["jobs"]["cpu"]["strategy"]["matrix"]["lane"]}
    assert lanes == {"default", "slow"} and "bash .ci/xla-lane" in runs(workflow)


def test_inf2_judges_the_12b_against_a_stored_golden_and_keeps_history_durably():
    workflow = load("inf2.yml")
    text = runs(workflow)
    assert "gemma-parity reference --checkpoint" in text
    assert re.search(r"gemma-parity check --backend neuron .*--checkpoint .*\n?.*--golden .*--report", text)
    assert "--junitxml" in text and workflow["jobs"]["check-12b"]["needs"] == "golden-12b"
    uses = [s.get("uses", "") + str(s.get("with", {}).get("path", "")) for j in workflow["jobs"].values()
            for s in j["steps"]]
    assert not any("actions/cache" in u and "perf-history" in u for u in uses), "the history is not in the cache"
    assert "push -q origin HEAD:perf-history" in text
