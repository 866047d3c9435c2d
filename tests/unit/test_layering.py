"""The package's imports flow one way (docs/design.md#import-layers): from the model facts at the bottom to the
commands at the top. Every import of a harness module, at module level or inside a function, is an
edge; an edge may only point to a lower or the same layer, the same-layer edges form no cycle, and
nothing below the command layer imports it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import harness

PACKAGE = Path(harness.__file__).parent

# Layer of every module (a package's modules share its layer unless listed). A new module must be
# placed here: an unplaced module fails the test, so the rule holds as the code grows.
LAYERS = {
    "harness": 0,
    "harness.base": 1, "harness.inputs": 1, "harness.port": 2, "harness.reference": 4, "harness.judge": 5, "harness.hlo": 1, "harness.parity": 5, "harness.quality": 6, "harness.report": 7,
    # 1: facts and plumbing every layer may use
    "harness.base.errors": 1, "harness.inputs.spec": 1, "harness.inputs.family": 1, "harness.inputs.validation": 1, "harness.base.numerics": 1,
    "harness.base.atomic": 1, "harness.base.progress": 1, "harness.hlo.ir": 1, "harness.base.points": 1, "harness.base.settings": 1,
    "harness.base.owned_dir": 1, "harness.base.array_index": 1, "harness.base.provenance": 1, "harness.inputs.assistant_spec": 1,
    # 2: weights, plans, inputs
    "harness.inputs.checkpoint": 2, "harness.inputs.weight_files": 2, "harness.inputs.tiny": 2, "harness.port.sharding": 2,
    "harness.perf.instances": 2, "harness.inputs.prompts": 2, "harness.port.device_plan": 2,
    "harness.perf.host_plan": 2, "harness.inputs.assistant_checkpoint": 2,
    # 3: the port
    "harness.port.model": 3, "harness.port.blocks": 3, "harness.port.graphs": 3, "harness.port.engine": 3,
    "harness.port.kv_slots": 3, "harness.port.batching": 3, "harness.port.drafter": 3, "harness.port.speculate": 3,
    # 4: execution: the backends, and the reference (transformers only)
    "harness.backends": 4, "harness.reference.run": 4, "harness.reference.stream": 4, "harness.reference.forcing": 4,
    "harness.reference.float64": 4, "harness.reference.assistant": 4, "harness.reference.tiny_assistant": 4,
    # 5: judgement
    # (observe runs the port and the references for the judge; stage judges what it observed)
    "harness.judge.compare": 5, "harness.parity.local": 5, "harness.reference.golden": 5, "harness.reference.golden_layout": 5,
    "harness.hlo.contracts": 5, "harness.judge.verdicts": 5, "harness.parity.observe": 5, "harness.judge.stage": 5,
    "harness.judge.results": 5, "harness.parity.bisect_result": 5, "harness.judge.routing": 5, "harness.parity.forced_path": 5,
    # 6: workflows as library functions with result objects
    "harness.parity.check": 6, "harness.parity.bisect": 6, "harness.parity.truncate": 6, "harness.perf": 6, "harness.hlo.stats": 6,
    "harness.parity.served": 6, "harness.quality.golden": 6, "harness.quality.stats": 6, "harness.quality.judge": 6,
    "harness.quality.parts": 6, "harness.quality.merge": 6, "harness.quality.moe": 6,
    "harness.parity.speculative": 6,
    # 7: presentation and commands; nothing imports these from below
    "harness.report.formats": 7, "harness.report.bisect": 7, "harness.report.plot": 7, "harness.report.table": 7,
    "harness.report.quality": 7,
    "harness.cli": 8, "harness.entry": 8, "harness.base.signal_guard": 8, "harness.__main__": 8,
}
TOP = ("harness.cli", "harness.entry", "harness.__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> int | None:
    """The layer of a module, or of the subpackage it sits in (never the root package's)."""
    if name in LAYERS:
        return LAYERS[name]
    while "." in name.rpartition(".")[0]:
        name = name.rpartition(".")[0]
        if name in LAYERS:
            return LAYERS[name]
    return None


def harness_imports(path: Path) -> set[str]:
    """Every harness module `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("harness")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            for alias in node.names:  # `from harness.cli import check` imports the module harness.cli.check
                sub = f"{node.module}.{alias.name}"
                found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).is_file() else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): harness_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imports in graph.items():
        if layer_of(module) is None:
            problems.append(f"{module}: not placed in a layer (add it to LAYERS)")
            continue
        for target in imports:
            if layer_of(target) is None:
                continue
            below_top = not module.startswith(TOP)
            if below_top and target.startswith(TOP):
                problems.append(f"{module} imports the command layer ({target})")
            elif layer_of(target) > layer_of(module):
                problems.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    return problems


def test_imports_flow_one_way():
    graph = import_graph()
    assert len(graph) > 20, "the walk found the package's modules"
    assert layering_violations(graph) == []
    assert find_cycle(graph) is None, find_cycle(graph)


def test_only_the_neuron_backend_imports_the_neuron_sdk():
    """Only the Neuron backend knows Neuron exists (docs/design.md#backends): backends/neuron.py and
    its NxD layers (neuron_layers.py), and neuron_env.py, through which they and `doctor` import the
    SDK by name."""
    for path in PACKAGE.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        if names & {"torch_neuronx", "neuronx_distributed", "libneuronxla"}:
            assert module_name(path) in ("harness.backends.neuron", "harness.backends.neuron_layers"), path
        if "import_module" in path.read_text() and module_name(path) != "harness.backends.neuron_env":
            assert not {"torch_neuronx", "neuronx_distributed", "libneuronxla"} & set(
                re.findall(r"import_module\(\s*[\"']([A-Za-z_]+)", path.read_text())), path


@pytest.mark.parametrize("graph, problem", [
    ({"harness.inputs.spec": {"harness.port.sharding"}, "harness.port.sharding": {"harness.inputs.spec"}}, "layer"),
    ({"harness.parity.bisect": {"harness.cli"}, "harness.cli": set()}, "command layer"),
    ({"harness.parity.check": {"harness.parity.bisect"}, "harness.parity.bisect": {"harness.parity.check"}}, "cycle"),
    ({"harness.newthing": set()}, "not placed"),
])
def test_the_rule_catches_each_kind_of_violation(graph, problem):
    """The checker itself: an upward import, an import of the commands, a same-layer cycle and an
    unplaced module are each reported."""
    found = layering_violations(graph) + ([f"cycle {find_cycle(graph)}"] if find_cycle(graph) else [])
    assert any(problem in p for p in found), found
