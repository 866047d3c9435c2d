"""Every reference to a file of the repository, in code, comments and docs, resolves in a clone:
paths such as `harness/port/engine.py` or `tests/faults/catalog.py`, "see <path>" phrases, and
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


# A Markdown link or image: [text](target) / ![alt](target), target relative to the file or #anchor.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def markdown_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def link_problems(root: Path) -> list[str]:
    """Every link of README.md and docs/*.md that is not a web address resolves from the file that
    holds it (as GitHub resolves it), and its #anchor is a heading of the target; every docs page
    is linked from the README."""
    found = []
    for page in markdown_pages(root):
        if not page.is_file():
            continue
        text = page.read_text(encoding="utf-8")
        for target in sorted({m[1] for m in LINK.finditer(text)}):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = page.relative_to(root)
            if not resolved.exists() or not resolved.is_relative_to(root.resolve()):
                found.append(f"{where}: link {target} does not resolve")
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                found.append(f"{where}: link {target}: no heading #{anchor}")
    readme = (root / "README.md").read_text(encoding="utf-8") if (root / "README.md").is_file() else ""
    linked = {m[1].partition("#")[0] for m in LINK.finditer(readme)}
    found += [f"README.md does not link docs/{p.name}" for p in sorted((root / "docs").glob("*.md"))
              if f"docs/{p.name}" not in linked]
    return found


def test_every_markdown_link_resolves_and_every_page_is_reachable():
    assert len(markdown_pages(ROOT)) > 5, "the docs pages were found"
    assert link_problems(ROOT) == []


@pytest.mark.parametrize("readme, page, problem", [
    ("[judging](docs/judging.md)\n", "[back](README.md)\n", "link README.md does not resolve"),
    ("[judging](docs/judging.md#nowhere)\n", "# Judging\n", "no heading #nowhere"),
    ("[judging](docs/judging.md)\n", "[stages](#no-such-section)\n# Judging\n", "no heading #no-such-section"),
    ("see the docs\n", "# Judging\n", "README.md does not link docs/judging.md"),
])
def test_the_link_checker_catches_each_kind_of_broken_link(tmp_path, readme, page, problem):
    """The checker itself: a link resolved from the wrong directory (docs/ pages link ../README.md),
    a missing anchor in another page or its own, and a page the README does not link are each
    reported; a small tree with valid links is clean."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Tool\n## Exit status\n[judging](docs/judging.md#judging)\n", encoding="utf-8")
    (tmp_path / "docs" / "judging.md").write_text("# Judging\n[back](../README.md#exit-status)\n", encoding="utf-8")
    assert link_problems(tmp_path) == []
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    (tmp_path / "docs" / "judging.md").write_text(page, encoding="utf-8")
    found = link_problems(tmp_path)
    assert any(problem in p for p in found), found


def test_the_tolerance_policy_cites_the_judge_by_name():
    """The design cites calibration constants by name, never by value: each exists in harness.judge.compare
    (the one place the numbers are written), so a renamed or removed constant fails here."""
    import harness.judge.compare as judge

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
