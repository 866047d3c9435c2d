"""HLO module text as lines the bundle's faults and reducer edit (harness/hlo/ir.py parses; this keeps each
instruction's own line so an edit changes only what it means to): the entry's instructions in order,
the other computations verbatim, and a renderer whose output XLA's text parser reads back (the header's
layout and alias attributes and the entry's signature are dropped: they are derived again on parse)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from harness.hlo.ir import _operand_names, _split_instruction

_CALLED = re.compile(r"(?:to_apply|calls|condition|body|true_computation|false_computation|"
                     r"branch_computations|scatter|select)=\{?%?([\w.\-]+)")


@dataclass
class Inst:
    name: str
    shape: str  # as printed, with layout
    opcode: str
    operands: list[str]
    line: str  # the instruction's text without a ROOT mark


@dataclass
class HloText:
    name: str
    computations: dict[str, list[str]]  # the non-entry computations' lines, header to closing brace
    entry_name: str
    entry: list[Inst] = field(default_factory=list)
    root: str = ""
    origin: list[int] | None = None  # parameter number now -> in the module parsed (after dce renumbers)

    def inst(self, name: str) -> Inst:
        return next(i for i in self.entry if i.name == name)

    def outputs(self) -> list[str]:
        root = self.inst(self.root)
        return root.operands if root.opcode == "tuple" else [root.name]


def parse(text: str) -> HloText:
    module, comp, lines, entry_lines, entry = None, None, [], None, None
    computations: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
        elif line.endswith("{") and "=" not in line.split("(")[0]:
            comp, lines = line.removeprefix("ENTRY ").split()[0].lstrip("%"), [raw]
            entry_lines = [] if line.startswith("ENTRY ") else None
        elif line == "}" and comp is not None:
            if entry_lines is None:
                computations[comp] = lines + [raw]
            else:
                out = HloText(module or "m", computations, comp)
                for body in entry_lines:
                    is_root, name, shape, opcode, operands, _ = _split_instruction(body)
                    names = [] if opcode in ("parameter", "constant", "iota") else _operand_names(operands)
                    out.entry.append(Inst(name, shape, opcode, names, body.removeprefix("ROOT ").strip()))
                    out.root = name if is_root else out.root
                entry = out
            comp = None
        elif comp is not None:
            lines.append(raw)
            if entry_lines is not None and _split_instruction(line) is not None:
                entry_lines.append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry


def called(lines_or_text) -> set[str]:
    text = lines_or_text if isinstance(lines_or_text, str) else "\n".join(lines_or_text)
    return set(_CALLED.findall(text)) | set(re.findall(r"branch_computations=\{([^}]*)\}", text))


def render(m: HloText) -> str:
    """The module as text, with only the computations its entry still calls."""
    wanted, todo = set(), [c for i in m.entry for c in called(i.line)]
    while todo:
        name = todo.pop().lstrip("%")
        if name in m.computations and name not in wanted:
            wanted.add(name)
            todo.extend(called(m.computations[name][1:]))
    out = [f"HloModule {m.name}", ""]
    for name, lines in m.computations.items():
        if name in wanted:
            out += lines + [""]
    out.append(f"ENTRY %{m.entry_name} {{")
    out += [f"  {'ROOT ' if i.name == m.root else ''}{i.line}" for i in m.entry]
    return "\n".join(out + ["}", ""])


def count(text: str) -> int:
    """Instructions in every computation of the module text."""
    return sum(1 for line in text.splitlines() if _split_instruction(line.strip()) is not None
               and not line.strip().startswith("HloModule"))


def live(m: HloText) -> set[str]:
    by_name = {i.name: i for i in m.entry}
    seen, todo = set(), [m.root]
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        todo.extend(by_name[name].operands)
    return seen


def dce(m: HloText) -> list[int]:
    """Drop what the root does not need, parameters too (renumbered in order): the old numbers kept."""
    keep = live(m)
    m.entry = [i for i in m.entry if i.name in keep]
    params = [i for i in m.entry if i.opcode == "parameter"]
    numbers = [int(re.search(r"parameter\((\d+)\)", i.line).group(1)) for i in params]
    order = sorted(range(len(params)), key=lambda k: numbers[k])
    for new, k in enumerate(order):
        params[k].line = re.sub(r"parameter\(\d+\)", f"parameter({new})", params[k].line)
    m.origin = [m.origin[numbers[k]] if m.origin is not None else numbers[k] for k in order]
    return list(m.origin)


def set_root(m: HloText, name: str) -> None:
    m.root = name


def literal(values: np.ndarray, dtype: str) -> str:
    def one(v):
        if dtype == "pred":
            return "true" if v else "false"
        if dtype[0] in "su":
            return str(int(v))
        v = float(v)
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)

    def nest(a):
        return one(a) if a.ndim == 0 else "{" + ", ".join(nest(x) for x in a) + "}"
    return nest(np.asarray(values))


def to_constant(m: HloText, name: str, value: np.ndarray) -> None:
    """Instruction `name` replaced by a constant of its value."""
    inst = m.inst(name)
    dtype = inst.shape.split("[")[0]
    inst.opcode, inst.operands = "constant", []
    inst.line = f"%{name} = {inst.shape} constant({literal(value, dtype)})"


def all_values_text(m: HloText) -> tuple[str, list[str]]:
    """The module with every array-shaped entry instruction an output (its values, once)."""
    names = [i.name for i in m.entry if not i.shape.startswith("(") and not i.shape.startswith("token")]
    probe = HloText(m.name, m.computations, m.entry_name, list(m.entry), root=m.root, origin=m.origin)
    shapes = ", ".join(probe.inst(n).shape for n in names)
    probe.entry = probe.entry + [Inst("all.values", f"({shapes})", "tuple", names,
                                      f"%all.values = ({shapes}) tuple({', '.join('%' + n for n in names)})")]
    probe.root = "all.values"
    return render(probe), names
