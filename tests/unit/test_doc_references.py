"""Every reference to a file of the repository, in code, comments and docs, resolves in a clone:
paths such as `harness/engine.py` or `tests/faults/catalog.py`, "see <path>" phrases, and
`docs/design.md#section` anchors (a heading of that file). No comment cites a design file that is
not in the repository (docs/design.md is the design)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = (".py", ".md", ".toml", ".yml", ".yaml")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "node_modules"}
TOP_DIRS = r"(?:harness|tests|fixtures|docs|benchmarks|\.ci|\.github)"
# A repository path (not part of a longer path such as /tmp/docs/x), with an optional #anchor.
PATH = re.compile(rf"(?<![\w/.~$-]){TOP_DIRS}/[\w./-]*\w(?:#[\w-]+)?")
SEE = re.compile(r"\bsee (?:`)?([\w.-]+(?:/[\w.-]+)+)", re.IGNORECASE)
# Paths that exist only in a build: setup.py copies fixtures/ into the package as harness/fixtures.
BUILT = {"harness/fixtures"}
STALE = re.compile(r"DESIGN(?:\.md)? ?§|shared/DESIGN")


def repo_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()
                  and not SKIP_DIRS & set(p.relative_to(root).parts)
                  and not any(part.startswith(".venv") for part in p.relative_to(root).parts))


def slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub renders it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


def resolves(root: Path, reference: str) -> bool:
    """A path exists (a module named with an attribute, harness/x.name, counts when harness/x.py
    does), and its #anchor, if any, is a heading of it."""
    target, _, anchor = reference.partition("#")
    if target.rstrip("./") in BUILT:
        return True
    path = root / target.rstrip(".")
    while not path.exists() and "." in path.name and path.with_suffix(".py") != path:
        if path.with_suffix(".py").exists():
            path = path.with_suffix(".py")
            break
        path = path.with_suffix("")
    if not path.exists():
        return False
    return not anchor or (path.suffix == ".md" and anchor in anchors(path))


def problems(root: Path) -> list[str]:
    found = []
    for file in repo_files(root):
        text = file.read_text(encoding="utf-8", errors="replace")
        where = file.relative_to(root)
        if file.name == Path(__file__).name:  # its own examples of broken references
            continue
        if STALE.search(text):
            found.append(f"{where}: cites a design file that is not in the repository ({STALE.search(text)[0]!r})")
        references = {m[0] for m in PATH.finditer(text)} | {m[1] for m in SEE.finditer(text)}
        found += [f"{where}: {ref} does not resolve" for ref in sorted(references) if not resolves(root, ref)]
    return found


def test_every_reference_resolves_in_a_clone():
    assert len(repo_files(ROOT)) > 100, "the walk found the repository's files"
    assert problems(ROOT) == []


def test_the_tolerance_policy_cites_the_judge_by_name():
    """The design cites calibration constants by name, never by value: each exists in harness.compare
    (the one place the numbers are written), so a renamed or removed constant fails here."""
    import harness.compare as judge

    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("## Tolerance policy", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", section))
    assert len(names) >= 10 and {"ENVELOPE_FACTOR", "FP32_FACTOR", "NEAR_TIE_FACTOR"} <= names
    assert sorted(n for n in names if not hasattr(judge, n)) == []


def test_the_design_document_has_the_sections_the_code_points_at():
    assert {"the-model-facts-and-traps", "the-port", "import-layers", "backends", "run-settings",
            "capture-points", "tolerance-policy", "performance-facts"} <= anchors(ROOT / "docs" / "design.md")


@pytest.mark.parametrize("text, problem", [
    ("# see harness/nothing_here.py for why\n", "harness/nothing_here.py does not resolve"),
    ("x = 1  # docs/design.md#no-such-section\n", "docs/design.md#no-such-section does not resolve"),
    ('"""see docs/missing.md"""\n', "docs/missing.md does not resolve"),
    ("# the rule (DESIGN §4)\n", "cites a design file"),
])
def test_the_checker_catches_each_kind_of_broken_reference(tmp_path, text, problem):
    """The checker itself, on a small tree: a missing file, a missing anchor, a "see" to nothing
    and a stale design citation are each reported; the same tree with valid references is clean."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## Import layers\n", encoding="utf-8")
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "engine.py").write_text("# see docs/design.md#import-layers\n", encoding="utf-8")
    assert problems(tmp_path) == []
    (tmp_path / "harness" / "bad.py").write_text(text, encoding="utf-8")
    found = problems(tmp_path)
    assert len(found) == 1 and problem in found[0], found
