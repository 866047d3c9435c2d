"""The package's imports flow one way (docs/design.md#import-layers), package by package: harness/ is
grouped into packages by layer, and a module imports only its own package and packages of a lower
layer (never one of the same layer: port and reference stand side by side, so the truth never leans
on the port). Every import of a harness module, at module level or inside a function, is an edge;
the edges form no cycle. The table below is the one table of the layers: docs/design.md's is
generated from it (`python tests/unit/test_layering.py --write-doc`) and checked against it here."""

from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path

import pytest

import harness

PACKAGE = Path(harness.__file__).parent
ROOT = PACKAGE.parent
DESIGN = ROOT / "docs" / "design.md"

# package (a folder of harness/, or a top-level module) -> (layer, what it holds). A new package or
# top-level module must be placed here: an unplaced one fails, so the rule holds as the code grows.
PACKAGES = {
    "harness": (0, "the root: the version and where the fixtures are"),
    "base": (1, "facts and plumbing every layer may use"),
    "inputs": (2, "what the user hands in, checked before model work; the tiny fixture"),
    "port": (3, "the decoder the device runs: TP plan, blocks, device graphs, host engine"),
    "reference": (3, "the truth: transformers only (imports nothing of the port), and the goldens"),
    "backends": (4, "where the port's graphs run: CPU, XLA, Neuron (the only code that knows the SDK)"),
    "judge": (4, "the one tolerance policy, its verdicts, the stage and routing decisions"),
    "hlo": (5, "the device graphs' HLO: parsed, checked against the contracts, measured"),
    "perf": (5, "benchmarks of the served build, their statistics, history, roofline floors"),
    "parity": (6, "check, the served check, bisect and truncate, and the observation they judge"),
    "quality": (6, "the corpus golden and its judged teacher-forced pass"),
    "bundle": (6, "a failing graph as an HLO bundle (module, inputs, expected outputs, compile command, "
                  "toolchain, check.sh), faults planted in its text, and its reducer"),
    "plan": (6, "what a run needs, counted before it starts: the device fit per NeuronCore (graphs' bytes held "
                "to the traced graphs), batch and KV fits, the memory plan, compile budget, host plan"),
    "report": (7, "what the commands print and write: tables, Markdown, JSON, plots"),
    "snapshot": (7, "one device call snapshotted, validated on read, replayed on any backend, a standalone repro"),
    "cli": (8, "the commands"),
    "entry": (9, "the console script (signal guard, then the commands)"),
    "__main__": (10, "`python -m harness` (the console script)"),
}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(name: str) -> str | None:
    """The entry of PACKAGES a module belongs to: harness.<pkg>[.<module>] -> <pkg>; harness -> harness."""
    parts = name.split(".")
    key = parts[1] if len(parts) > 1 else parts[0]
    return key if key in PACKAGES else None


def harness_imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every harness module `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "harness"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "harness":
            for alias in node.names:  # `from harness.cli import check` imports the module harness.cli.check
                sub = f"{node.module}.{alias.name}"
                is_module = (package.parent / (sub.replace(".", "/") + ".py")).is_file() or \
                    (package.parent / sub.replace(".", "/") / "__init__.py").is_file()
                found.add(sub if is_module else node.module)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    return {module_name(p, package): harness_imports(p, package) for p in sorted(package.rglob("*.py"))
            if "__pycache__" not in p.parts}


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
    """Each import of a package of a higher layer, or of another package of the same layer."""
    problems = []
    for module, imports in sorted(graph.items()):
        home = package_of(module)
        if home is None:
            problems.append(f"{module}: its package is not placed in a layer (add it to PACKAGES)")
            continue
        for target in sorted(imports):
            there = package_of(target)
            if there is None or there == home or there == "harness":
                continue
            if PACKAGES[there][0] > PACKAGES[home][0]:
                problems.append(f"{module} ({home}, layer {PACKAGES[home][0]}) imports {target} "
                                f"({there}, layer {PACKAGES[there][0]}): an upward import")
            elif PACKAGES[there][0] == PACKAGES[home][0]:
                problems.append(f"{module} ({home}) imports {target} ({there}), a package of the same "
                                f"layer {PACKAGES[home][0]}: move one of them, or the shared part lower")
    return problems


def test_imports_flow_one_way():
    graph = import_graph()
    assert len(graph) > 40, "the walk found the package's modules"
    assert layering_violations(graph) == []
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_folders_are_the_table():
    """Every folder of harness/ and every top-level module is a row of PACKAGES and every row is on
    disk (the table has no stale rows); no module name repeats its folder as a prefix."""
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    on_disk |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {"harness"}
    assert on_disk == set(PACKAGES)
    assert [p for p in PACKAGE.glob("*/*.py") if p.stem.startswith(p.parent.name + "_")] == []


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
    ({"harness.base.a": {"harness.inputs.b"}, "harness.inputs.b": set()}, "upward import"),
    ({"harness.parity.a": {"harness.cli.common"}, "harness.cli.common": set()}, "upward import"),
    ({"harness.port.a": {"harness.reference.b"}, "harness.reference.b": set()}, "same layer"),
    ({"harness.judge.a": {"harness.judge.b"}, "harness.judge.b": {"harness.judge.a"}}, "cycle"),
    ({"harness.newthing.a": set()}, "not placed"),
])
def test_the_rule_catches_each_kind_of_violation(graph, problem):
    """The checker itself: an upward import (one below the commands, one of the commands), a
    sideways one between packages of a layer, a cycle and an unplaced package are each reported."""
    found = layering_violations(graph) + ([f"cycle {find_cycle(graph)}"] if find_cycle(graph) else [])
    assert any(problem in p for p in found), found


def test_a_planted_upward_import_fails(tmp_path):
    """On a copy of the real package: clean as it is, and an import of the commands planted inside a
    function of base/errors.py is reported with both ends named."""
    copy = tmp_path / "harness"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert layering_violations(import_graph(copy)) == []
    errors = copy / "base" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _planted():\n    from harness.cli import common\n")
    found = layering_violations(import_graph(copy))
    assert len(found) == 1 and "harness.base.errors" in found[0] and "harness.cli.common" in found[0], found


# ---- the design doc's table ----------------------------------------------------------------------

def layer_table(package: Path = PACKAGE) -> list[str]:
    """docs/design.md's import-layers table: one row per package, its modules as they are on disk."""
    rows = ["| layer | package | modules | holds |", "|---|---|---|---|"]
    for name, (layer, holds) in sorted(PACKAGES.items(), key=lambda item: item[1][0]):
        if name == "harness":
            where, modules = "`harness`", "`__init__`"
        elif (package / name).is_dir():
            where = f"`{name}/`"
            modules = ", ".join(f"`{p.stem}`" for p in sorted((package / name).glob("*.py")) if p.stem != "__init__")
        else:
            where, modules = f"`{name}.py`", ""
        rows.append(f"| {layer} | {where} | {modules} | {holds} |")
    return rows


def doc_table(text: str) -> list[str]:
    """The table (contiguous `|` lines) in the doc's "## Import layers" section."""
    section = text.split("\n## Import layers\n", 1)[1].split("\n## ", 1)[0] if "\n## Import layers\n" in text else ""
    lines = section.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_the_design_doc_table_is_this_table():
    assert doc_table(DESIGN.read_text(encoding="utf-8")) == layer_table(), \
        "docs/design.md#import-layers differs from PACKAGES: run `python tests/unit/test_layering.py --write-doc`"


def test_the_doc_check_catches_a_stale_table():
    """The checker itself: a doc whose table lacks a module, or has none, differs from the table."""
    good = "# Design\n\n## Import layers\n\nprose\n\n" + "\n".join(layer_table()) + "\n\n## Backends\n"
    assert doc_table(good) == layer_table()
    stale = good.replace("`errors`, ", "")
    assert stale != good and doc_table(stale) != layer_table()
    assert doc_table("# Design\n\n## Import layers\n\nprose only\n") != layer_table()


def write_doc(path: Path = DESIGN) -> None:
    """Replace the table in docs/design.md's import-layers section (or add it at the section's end)."""
    text = path.read_text(encoding="utf-8")
    head, marker, rest = text.partition("\n## Import layers\n")
    assert marker, f"{path}: no '## Import layers' section"
    section, sep, tail = rest.partition("\n## ")
    old = doc_table(text)
    table = "\n".join(layer_table())
    section = section.replace("\n".join(old), table, 1) if old else section.rstrip("\n") + "\n\n" + table + "\n"
    path.write_text(head + marker + section + sep + tail, encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-doc"]:
        write_doc()
    else:
        print("\n".join(layer_table()))
