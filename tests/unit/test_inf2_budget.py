"""The inf2 workflow's device jobs against the compile budget (harness/plan/compile_budget.py): each
job's timeout holds the cold compile of every device build it makes, counted from what makes them:
the `gemma-parity check|bench` lines of its steps (the builds `info --plan` plans for their options)
and the `neuron` tests its `pytest -m neuron` steps collect (each such module declares its builds in
DEVICE_BUILDS; a build made twice, by a test and a command, compiles once: the cache)."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest
import yaml

from harness import FIXTURES_DIR
from harness.backends.neuron_build import kv_tags
from harness.inputs.spec import load_spec
from harness.plan.compile_budget import compile_minutes, graphs_by_stage
from harness.port.sharding import bytes_per_rank

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "inf2.yml"
SETUP_MINUTES = 30  # venv, checkout, the runs themselves (the compiles are planned below)
SPECS = {"12b": FIXTURES_DIR / "configs" / "gemma-4-12b-it.json", "tiny": FIXTURES_DIR / "configs" / "gemma-4-tiny.json"}


def _device_jobs() -> dict:
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    return {name: job for name, job in jobs.items() if "inf2" in job.get("runs-on", [])}


def _marks_neuron(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "neuron" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(tree))


def neuron_modules(under: Path = ROOT / "tests") -> dict[Path, list | None]:
    """Every test module (or conftest) that marks something `neuron` -> its DEVICE_BUILDS (None: undeclared)."""
    found = {}
    for path in sorted(under.rglob("*.py")):
        if "nxd_double" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        if not _marks_neuron(tree):
            continue
        declared = None
        for node in tree.body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            if any(isinstance(t, ast.Name) and t.id == "DEVICE_BUILDS" for t in targets) and node.value is not None:
                declared = ast.literal_eval(node.value)
        found[path] = declared
    return found


def build_key(b: dict) -> tuple:
    return (b["model"], tuple(sorted(b["buckets"])), b["kv_len"], b.get("batch", 1), b["capture"], b.get("tp", 2))


def build_graphs(b: dict) -> int:
    """The graphs a build traces: the backend's own tags (neuron_build.kv_tags)."""
    return len(kv_tags(tuple(b["buckets"]), b["kv_len"], b.get("batch", 1)))


def command_builds(run: str) -> list[dict]:
    """The 12B builds of every `gemma-parity check|bench` line of a step, by the plan's stages."""
    builds = []
    for line in run.replace("\\\n", " ").splitlines():
        words = shlex.split(line.strip(), comments=True) if "gemma-parity" in line else []
        if len(words) < 2 or words[0] != "gemma-parity" or words[1] not in ("check", "bench"):
            continue
        opt = {w: words[i + 1] if i + 1 < len(words) else "" for i, w in enumerate(words) if w.startswith("--")}
        buckets = [int(b) for b in opt.get("--buckets", "64,256").split(",")]
        batch = int(opt["--batch"]) if "--batch" in opt else 1
        common = {"model": "12b", "buckets": buckets, "kv_len": int(opt.get("--kv-len", 256)), "tp": int(opt.get("--tp", 2))}
        stages = graphs_by_stage(words[1], buckets, common["kv_len"], batch=batch, served="--skip-served-build" not in opt)
        for stage, graphs in stages.items():
            b = {**common, "batch": 4 if stage == "batch stage" else batch, "capture": stage in ("parity build", "batch stage")}
            assert build_graphs(b) == graphs, (stage, b)  # the plan counts what the backend traces
            builds.append(b)
    return builds


def neuron_test_builds(job: dict) -> list[dict]:
    """The builds of the `neuron` tests a job's `pytest -m neuron [PATHS]` steps collect."""
    builds = []
    for step in job["steps"]:
        for line in step.get("run", "").splitlines():
            words = shlex.split(line, comments=True) if line.strip().startswith("pytest ") else []
            if words[:3] != ["pytest", "-m", "neuron"]:
                continue
            paths = [ROOT / w for w in words[3:] if not w.startswith("-") and (ROOT / w).exists()] or [ROOT / "tests"]
            for module, declared in neuron_modules().items():
                if any(p == module or p in module.parents for p in paths):
                    builds += declared
    return builds


def job_cold_minutes(job: dict) -> tuple[float, list[dict]]:
    """The cold compile of every distinct build a job makes, as the plan budgets it."""
    builds = command_builds("\n".join(s.get("run", "") for s in job["steps"])) + neuron_test_builds(job)
    unique = {build_key(b): b for b in builds}
    minutes = 0.0
    for model in SPECS:
        mine = [b for b in unique.values() if b["model"] == model]
        if mine:
            weights = bytes_per_rank(load_spec(SPECS[model]), 2, "bfloat16", 256)["weights"]
            minutes += compile_minutes([build_graphs(b) for b in mine], weights)["minutes"]
    return minutes, list(unique.values())


def test_every_neuron_test_module_declares_its_device_builds():
    """A `neuron` test that builds without saying so would be a build no plan counts."""
    modules = neuron_modules()
    assert ROOT / "tests" / "perf" / "test_device_budgets.py" in modules
    assert not [str(p) for p, declared in modules.items() if declared is None]


def test_the_scan_finds_an_undeclared_neuron_module(tmp_path):
    (tmp_path / "test_x.py").write_text("import pytest\npytestmark = pytest.mark.neuron\n")
    (tmp_path / "test_y.py").write_text("import pytest\npytestmark = pytest.mark.neuron\nDEVICE_BUILDS = []\n")
    assert neuron_modules(tmp_path) == {tmp_path / "test_x.py": None, tmp_path / "test_y.py": []}


def test_every_device_job_fits_its_cold_budget():
    """Each device job's timeout holds the cold compile of every build its commands and its `-m neuron`
    tests make (the device job: the tests' two 12B perf builds, 6 and 24 graphs, the bench's reused)."""
    jobs = _device_jobs()
    assert {"device", "check-12b"} <= set(jobs)
    for name, job in jobs.items():
        cold, builds = job_cold_minutes(job)
        assert any(b["model"] == "12b" for b in builds), name  # each runs the 12B on the device
        assert job["timeout-minutes"] >= cold + SETUP_MINUTES, (name, job["timeout-minutes"], cold)
    device = {build_key(b) for b in job_cold_minutes(jobs["device"])[1] if b["model"] == "12b"}
    assert device == {("12b", (64,), 256, 1, False, 2), ("12b", (64,), 256, 8, False, 2)}


def test_the_budget_counts_the_tests_builds_not_only_the_commands():
    """The old budget counted only `gemma-parity` lines: the device job's tests' batch-8 build (24
    graphs) was outside it. Dropping the tests' declarations drops them from the count."""
    job = _device_jobs()["device"]
    with_tests, _ = job_cold_minutes(job)
    commands_only = job_cold_minutes({"steps": [s for s in job["steps"] if "pytest" not in s.get("run", "")]})[0]
    assert with_tests > commands_only
    assert build_graphs({"buckets": [64], "kv_len": 256, "batch": 8}) == 24


def test_the_budget_reads_the_command_line():
    """A check's builds follow its options: --batch 4 builds every graph at batch buckets 1, 2, 4."""
    default = command_builds('gemma-parity check --backend neuron --tp 2 --checkpoint "$X" --golden g')
    batched = command_builds("gemma-parity check --backend neuron --tp 2 --batch 4")
    assert [build_graphs(b) for b in default] == [7, 7]
    assert [build_graphs(b) for b in batched] == [21, 21]


def test_every_budget_line_names_its_figures_and_workers(monkeypatch, tmp_path):
    """The per-graph figure is published, not measured (no device here), with its source stated as
    issue 1210 has it (an ArgMax made 22 min; ~1 min without); the workers come from the instance's
    host memory and vCPUs with the reason; budget = ceil(graphs / workers) x per graph per build."""
    from harness.plan import compile_budget
    from harness.plan.host_plan import render_resource_plan, resource_plan, summary_line

    monkeypatch.setenv("GEMMA_PARITY_CALIBRATION", str(tmp_path / "none.json"))
    spec = load_spec(SPECS["12b"])
    plan = resource_plan(spec, 2, "bfloat16", 256, (64, 256))
    budget = plan["commands"]["check"]["compile"]
    assert "min per graph" in summary_line(plan, "check") and "published, not measured" in summary_line(plan, "check")
    assert "ArgMax" in compile_budget.PUBLISHED_SOURCE and "22" in compile_budget.PUBLISHED_SOURCE
    assert compile_budget.PUBLISHED_SOURCE in render_resource_plan(plan) and "vCPUs" in budget["workers_reason"]
    assert budget["minutes"] == sum(-(-n // budget["workers"]) for n in (7, 7)) * budget["per_graph"]
    one = compile_budget.compile_minutes([24], 11 * 2**30, host_bytes=128 * 2**30, cpus=4)
    assert one["workers"] == 2 and one["minutes"] == 12 * one["per_graph"]  # 4 vCPUs: 2 compiles at once
    refusal = compile_budget.refuse_over_budget("check", plan["commands"]["check"]["graphs_by_stage"], budget, 1)
    assert "published, not measured by this project" in refusal


@pytest.mark.parametrize("fixture", ["calibration-fixture.json"])
def test_a_recorded_calibration_replaces_the_published_figures(monkeypatch, fixture):
    """A calibration file (a test fixture, labelled so: not a measurement) gives the budget its
    minutes per graph and the compiler's peak host memory, and the plan says where they come from."""
    from harness.plan.host_plan import render_resource_plan, resource_plan, summary_line

    path = FIXTURES_DIR / "calibration" / fixture
    monkeypatch.setenv("GEMMA_PARITY_CALIBRATION", str(path))
    plan = resource_plan(load_spec(SPECS["12b"]), 2, "bfloat16", 256, (64, 256))
    budget = plan["commands"]["check"]["compile"]
    assert budget["basis"] == "measured" and budget["per_graph"] == 12.5  # 1500 s x 2 workers / 4 graphs / 60
    assert budget["workers"] == (128 - 11) // 24  # the measured 24 GiB peak per compile, not the estimate
    assert "(12.5 min per graph" in summary_line(plan, "check")
    text = render_resource_plan(plan)
    assert "TEST FIXTURE, not a measurement" in text and "measured 13.10 GiB per core after load" in text
