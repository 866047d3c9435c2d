"""The inf2 workflow's device jobs against the compile budget (harness/plan/compile_budget.py): each
restores the harness's compile cache, and its timeout holds the cold compile of the 12B commands it
runs, as `info --plan` plans them for the options on their command lines, with room for setup."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from harness import FIXTURES_DIR
from harness.inputs.spec import load_spec
from harness.plan.compile_budget import compile_minutes, graphs_by_stage
from harness.port.sharding import bytes_per_rank

WORKFLOW = Path(__file__).resolve().parents[2] / ".github" / "workflows" / "inf2.yml"
SETUP_MINUTES = 30  # venv, checkout, the -m neuron suites' tiny builds (not planned)


def _device_jobs() -> dict:
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    return {name: job for name, job in jobs.items() if "inf2" in job.get("runs-on", [])}


def cold_minutes(run: str) -> float:
    """The planned cold compile of every `gemma-parity check|bench` line of a step (12B, TP 2), as
    `info --plan` plans it (host_plan.resource_plan's graphs_by_stage and compile_minutes)."""
    spec = load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")
    total = 0.0
    for line in run.replace("\\\n", " ").splitlines():
        words = shlex.split(line.strip(), comments=True) if "gemma-parity" in line else []
        if len(words) < 2 or words[0] != "gemma-parity" or words[1] not in ("check", "bench"):
            continue
        opt = {w: words[i + 1] if i + 1 < len(words) else "" for i, w in enumerate(words) if w.startswith("--")}
        buckets = tuple(int(b) for b in opt.get("--buckets", "64,256").split(","))
        batch = int(opt["--batch"]) if "--batch" in opt and words[1] == "check" else 1
        tp, kv_len = int(opt.get("--tp", 2)), int(opt.get("--kv-len", 256))
        stages = graphs_by_stage(words[1], buckets, kv_len, batch=batch, served="--skip-served-build" not in opt)
        total += compile_minutes(sum(stages.values()), bytes_per_rank(spec, tp, "bfloat16", kv_len)["weights"])["minutes"]
    return total


def test_every_device_job_restores_the_compile_cache_and_fits_its_cold_budget():
    jobs = _device_jobs()
    assert {"device", "check-12b"} <= set(jobs)
    for name, job in jobs.items():
        steps = job["steps"]
        restores = [s for s in steps if str(s.get("uses", "")).startswith("actions/cache")]
        assert restores and restores[0]["with"]["path"] == ".cache/gemma-parity", name
        cold = sum(cold_minutes(s.get("run", "")) for s in steps)
        assert cold > 0, name  # each runs a 12B device command
        assert job["timeout-minutes"] >= cold + SETUP_MINUTES, (name, job["timeout-minutes"], cold)
    keys = [next(s for s in j["steps"] if str(s.get("uses", "")).startswith("actions/cache"))["with"]["key"]
            for j in jobs.values()]
    assert len(set(keys)) == len(keys)  # one entry per job: the first to finish would keep the other's out


def test_the_budget_reads_the_command_line():
    """A check with a batch stage of 4 slots costs its batches' graphs; the planted 240-minute
    timeout of the check job before this change is under the default check's cold budget."""
    default = cold_minutes('gemma-parity check --backend neuron --tp 2 --checkpoint "$X" --golden g')
    batched = cold_minutes("gemma-parity check --backend neuron --tp 2 --batch 4")
    assert default == 14 * 22.0 and batched == 2 * 21 * 22.0
    assert 240 < default + SETUP_MINUTES


def test_every_budget_line_names_whether_its_figure_was_measured(monkeypatch):
    """The 22 min per graph is published, not measured (no device here): the plan's line before a
    command, the plan's table and the refusal say so, and say "measured" once a figure is set."""
    from harness import FIXTURES_DIR
    from harness.inputs.spec import load_spec
    from harness.plan import compile_budget
    from harness.plan.host_plan import render_resource_plan, resource_plan, summary_line

    spec = load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")
    plan = resource_plan(spec, 2, "bfloat16", 256, (64, 256))
    assert "(22 min per graph, published, not measured)" in summary_line(plan, "check")
    assert compile_budget.PUBLISHED_SOURCE in render_resource_plan(plan)
    budget = plan["commands"]["check"]["compile"]
    refusal = compile_budget.refuse_over_budget("check", plan["commands"]["check"]["graphs_by_stage"], budget, 10)
    assert "published, not measured by this project" in refusal
    monkeypatch.setattr(compile_budget, "MEASURED_MINUTES_PER_GRAPH", 9.0)
    measured = resource_plan(spec, 2, "bfloat16", 256, (64, 256))
    assert "(9 min per graph, measured)" in summary_line(measured, "check")
    assert measured["commands"]["check"]["compile"]["minutes"] == 14 * 9.0
