"""One job per module, kept small (docs/testing.md): no module in harness/ over MAX_MODULE_LINES
lines and no function over MAX_FUNCTION_LINES lines. An exception is listed here with its reason;
an exception that is no longer needed fails too, so the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

import harness

PACKAGE = Path(harness.__file__).parent
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60
# module path (relative to harness/) -> why it may be longer
LONG_MODULES: dict[str, str] = {}
# (module path, function name) -> why it may be longer
LONG_FUNCTIONS: dict[tuple[str, str], str] = {}


def module_lines(source: str) -> int:
    return len(source.splitlines())


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source` longer than `limit` lines, counted
    from its `def` (decorators excluded) to its last line."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def sources() -> dict[str, str]:
    found = {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(found) > 30  # the package was found, not an empty directory
    return found


def test_no_module_is_over_the_size_limit():
    sizes = {path: module_lines(text) for path, text in sources().items()}
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES and p not in LONG_MODULES} == {}
    assert [p for p in LONG_MODULES if sizes.get(p, 0) <= MAX_MODULE_LINES] == []  # stale exceptions


def test_no_function_is_over_the_size_limit():
    found = {(path, name): n for path, text in sources().items() for name, n in long_functions(text)}
    assert {k: n for k, n in found.items() if k not in LONG_FUNCTIONS} == {}
    assert [k for k in LONG_FUNCTIONS if k not in found] == []  # stale exceptions


def test_the_checks_measure_what_they_claim():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    method = body.replace("    x", "        x")
    source = f"def long():\n{body}\ndef short():\n    pass\nclass C:\n    def method(self):\n{method}"
    assert long_functions(source) == [("long", MAX_FUNCTION_LINES + 1), ("method", MAX_FUNCTION_LINES + 1)]
    assert long_functions("def f():\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1)) == []
    assert module_lines("a\nb\nc\n") == 3
