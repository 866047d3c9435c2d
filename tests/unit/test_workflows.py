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


# --- the linters teams run on workflows (pyproject's `lint` extra), and the device workflow's gate ---

ACTIONLINT_CONFIG = WORKFLOWS.parent / "actionlint.yaml"


def _lint(tool: str, workflows: Path) -> list[str]:
    """The findings of `tool` on every workflow in `workflows`, one string each (empty: clean)."""
    import json
    import shutil
    import subprocess

    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed: pip install -e '.[lint]' (the README's test command installs it)")
    files = sorted(str(p) for p in workflows.glob("*.yml"))
    if tool == "actionlint":
        run = subprocess.run(["actionlint", "-config-file", str(ACTIONLINT_CONFIG), "-format",
                              "{{range $e := .}}{{$e.Filepath}}:{{$e.Line}}: {{$e.Message}}\n{{end}}", *files],
                             capture_output=True, text=True, timeout=120)
        findings = [line for line in run.stdout.splitlines() if line.strip()]
        assert run.returncode in (0, 1) and (run.returncode == 1) == bool(findings), run.stderr
        return findings
    run = subprocess.run(["zizmor", "--offline", "--no-progress", "--format", "json", *files],
                         capture_output=True, text=True, timeout=120)
    findings = json.loads(run.stdout or "null")
    assert isinstance(findings, list), run.stderr  # a crash or a usage error is not "clean"
    return [f"{f['ident']}: {f['desc']}" for f in findings]


@pytest.mark.parametrize("tool", ["actionlint", "zizmor"])
def test_the_workflows_lint_clean(tool):
    """actionlint (the self-hosted labels from .github/actionlint.yaml) and zizmor's default persona,
    offline: no finding on any workflow."""
    assert _lint(tool, WORKFLOWS) == []


def test_the_workflow_scripts_pass_shellcheck():
    """The scripts the workflows run: shellcheck on the files (actionlint runs it on the `run:` blocks
    above when it is on PATH, as on GitHub's runners; the lint extra installs it)."""
    import shutil
    import subprocess

    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed: pip install -e '.[lint]' (the README's test command installs it)")
    scripts = [WORKFLOWS.parent / "inf2-preconditions.sh", WORKFLOWS.parent / "inf2-compile-cache.sh",
               WORKFLOWS.parents[1] / ".ci" / "run"]
    run = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("tool", ["actionlint", "zizmor"])
def test_the_lint_check_reports_a_workflow_with_the_old_faults(tool, tmp_path):
    """The check above can fail: a workflow with a node20 action by tag, an undeclared self-hosted
    label, a persisted checkout token and a template expanded into `run:` is reported by each tool."""
    (tmp_path / "bad.yml").write_text(
        "name: bad\non: pull_request\njobs:\n  a:\n    runs-on: [self-hosted, gpu9]\n    steps:\n"
        "      - uses: actions/checkout@v4\n"
        "      - run: echo \"${{ github.event.pull_request.title }}\"\n")
    assert _lint(tool, tmp_path)


def _gated(job: dict) -> bool:
    condition = " ".join(str(job.get("if", "")).split())
    return ("github.event_name != 'pull_request' ||" in condition
            and "github.event.pull_request.head.repo.full_name == github.repository" in condition
            and "contains(github.event.pull_request.labels.*.name, 'inf2')" in condition)


def test_no_fork_pull_request_reaches_a_self_hosted_runner():
    """Every job of every workflow that runs on a self-hosted runner is skipped for a pull request
    unless it comes from a branch of this repository and carries the `inf2` label; its first step
    after the checkout checks the variables and instance it assumes."""
    self_hosted = 0
    for name in ("pr.yml", "nightly.yml", "inf2.yml"):
        workflow = load(name)
        for job_name, job in workflow["jobs"].items():
            labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
            if "self-hosted" not in labels:
                continue
            self_hosted += 1
            assert _gated(job), (name, job_name)
            steps = job["steps"]
            assert steps[0]["uses"].startswith("actions/checkout@")
            assert steps[1]["run"].startswith("bash .github/inf2-preconditions.sh "), (name, job_name)
    assert self_hosted == 3
    assert load("inf2.yml")["permissions"] == {}


def _evaluate_gate(condition: str, event: str, head: str, labels: list[str], action: str, label: str = "") -> bool:
    """The job's `if:` expression evaluated on one event, by rewriting its few operators to Python."""
    from types import SimpleNamespace as NS

    expression = (" ".join(condition.split()).replace("||", " or ").replace("&&", " and ")
                  .replace("github.event.pull_request.labels.*.name", "label_names")
                  .replace("contains(label_names, 'inf2')", "('inf2' in label_names)"))
    github = NS(event_name=event, repository="org/gemma-parity",
                event=NS(action=action, label=NS(name=label),
                         pull_request=NS(head=NS(repo=NS(full_name=head)))))
    return bool(eval(expression, {"__builtins__": {}}, {"github": github, "label_names": labels}))


def test_the_gate_condition_rejects_the_fork_case():
    """The device jobs' `if:` as written in inf2.yml, evaluated on the events: a fork's pull request
    is skipped labelled or not; a branch of the repository runs only with the `inf2` label; pushes run."""
    for job_name in ("device", "golden-12b", "check-12b"):
        condition = load("inf2.yml")["jobs"][job_name]["if"]
        assert not _evaluate_gate(condition, "pull_request", "stranger/gemma-parity", ["inf2"], "synchronize")
        assert not _evaluate_gate(condition, "pull_request", "stranger/gemma-parity", ["inf2"], "labeled", "inf2")
        assert not _evaluate_gate(condition, "pull_request", "org/gemma-parity", [], "opened")
        assert not _evaluate_gate(condition, "pull_request", "org/gemma-parity", ["inf2", "docs"], "labeled", "docs")
        assert _evaluate_gate(condition, "pull_request", "org/gemma-parity", ["inf2"], "labeled", "inf2")
        assert _evaluate_gate(condition, "push", "", [], "")


@pytest.mark.parametrize("mode", ["device", "golden"])
def test_the_preconditions_step_names_what_is_missing(mode, tmp_path):
    """.github/inf2-preconditions.sh fails with one `::error::` line per missing assumption and
    passes once the checkpoint (and, for the device, a Neuron device node and neuron-ls) are there."""
    import os
    import subprocess

    script = WORKFLOWS.parent / "inf2-preconditions.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "NEURON_DEVICE_GLOB": str(tmp_path / "dev" / "neuron[0-9]*"),
           "PYTHON": "sh", "GEMMA_PARITY_12B_CHECKPOINT": ""}
    run = subprocess.run(["bash", str(script), mode], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "GEMMA_PARITY_12B_CHECKPOINT is empty" in run.stdout
    if mode == "device":
        assert "no Neuron device" in run.stdout and "neuron-ls is not on PATH" in run.stdout
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    env["GEMMA_PARITY_12B_CHECKPOINT"] = str(ckpt)
    run = subprocess.run(["bash", str(script), mode], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "no *.safetensors" in run.stdout
    (ckpt / "model.safetensors").write_text("")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "neuron0").write_text("")
    (bin_dir / "neuron-ls").write_text("#!/bin/sh\n")
    os.chmod(bin_dir / "neuron-ls", 0o755)
    run = subprocess.run(["bash", str(script), mode], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "::error::" not in run.stdout, run.stdout


def _step_index(steps: list, predicate) -> int:
    return next(i for i, s in enumerate(steps) if predicate(s))


@pytest.mark.parametrize("job_name", ["device", "check-12b"])
def test_the_compile_cache_survives_a_failed_run(job_name):
    """Each device job restores and saves its compile cache in separate steps, the save after every
    compiling step (each `gemma-parity check|bench` and `pytest -m neuron`) under always(), keyed
    per run (an entry is never overwritten) and restored by prefix; the two device jobs share one
    concurrency group (never both on the NeuronCores)."""
    job = load("inf2.yml")["jobs"][job_name]
    steps = job["steps"]
    uses = [str(s.get("uses", "")) for s in steps]
    assert not any(u.startswith("actions/cache@") for u in uses), "actions/cache saves only on success"
    restore = _step_index(steps, lambda s: str(s.get("uses", "")).startswith("actions/cache/restore@"))
    save = _step_index(steps, lambda s: str(s.get("uses", "")).startswith("actions/cache/save@"))
    compiling = [i for i, s in enumerate(steps) if re.search(r"gemma-parity (check|bench)|pytest -m neuron", s.get("run", ""))]
    assert restore < min(compiling) and save > max(compiling), (restore, compiling, save)
    assert "always()" in steps[save]["if"] and "always()" in steps[save - 1]["if"]  # the prune step decides
    assert "github.run_id" in steps[restore]["with"]["key"] and steps[restore]["with"]["restore-keys"].strip()
    assert steps[save]["with"]["key"] == "${{ steps.restore-compile.outputs.cache-primary-key }}"
    assert steps[save]["with"]["path"] == steps[restore]["with"]["path"] == ".cache/gemma-parity"
    assert job["concurrency"] == {"group": "inf2-neuroncores", "cancel-in-progress": False}


def test_the_compile_cache_prune_keeps_a_failed_runs_entries(tmp_path):
    """.github/inf2-compile-cache.sh: after a successful job the entries it did not use are pruned
    (and the save is asked for); after a failed one nothing is pruned; an unchanged cache is not saved."""
    import os
    import subprocess
    import time

    script = WORKFLOWS.parent / "inf2-compile-cache.sh"
    neuron = tmp_path / "cache" / "neuron"
    (neuron / "stale").mkdir(parents=True)
    (neuron / "used").mkdir()
    old = time.time() - 3600
    for name in ("stale", "used"):
        os.utime(neuron / name, (old, old))
    env = {"PATH": "/usr/bin:/bin", "GEMMA_PARITY_CACHE": str(tmp_path / "cache"), "RUNNER_TEMP": str(tmp_path)}

    def run(*args) -> str:
        out = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    run("mark")
    assert run("changed", "success").strip().endswith("changed=false") is False  # "stale" pruned: changed
    assert sorted(p.name for p in neuron.iterdir()) == []  # nothing touched: every entry was stale
    (neuron / "stale").mkdir()
    (neuron / "used").mkdir()
    for name in ("stale", "used"):
        os.utime(neuron / name, (old, old))
    run("mark")
    os.utime(neuron / "used")  # a load touches its entry
    (neuron / "new").mkdir()  # a compile publishes one
    assert "changed=true" in run("changed", "failure")
    assert sorted(p.name for p in neuron.iterdir()) == ["new", "stale", "used"]  # a failed job prunes nothing
    run("changed", "success")
    assert sorted(p.name for p in neuron.iterdir()) == ["new", "used"]
    run("mark")
    assert "changed=false" in run("changed", "failure")
