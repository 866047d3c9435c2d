"""Reads HLO text (as torch-xla prints it, or as XLA dumps it for any backend) into a small IR.

No XLA needed: the module header (input/output aliases, buffer donors), every computation and its
instructions (name, shape, opcode, operands, attributes) are parsed from the text, so the graph
contracts and statistics can run on what either lane lowered: torch-xla on CPU here, or the HLO
that torch-neuronx handed to neuronx-cc on an inf2 host.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"([a-z]+\d*)\[([^\]]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_ALIAS = re.compile(r"\{([\d,\s]*)\}\s*:\s*\((\d+),\s*\{([\d,\s]*)\}")


@dataclass(frozen=True)
class Array:
    """One array shape: dtype and dims; `dynamic` when any dim is bounded-dynamic (<=N) or '?'."""
    dtype: str
    dims: tuple[int, ...]
    dynamic: bool = False

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return self.elements * DTYPE_BYTES.get(self.dtype, 0)


def parse_shape(text: str) -> list[Array]:
    """Every array in a shape string (a tuple shape gives several, in order)."""
    arrays = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in DTYPE_BYTES and dtype != "token":
            continue
        parts = [d.strip() for d in dims.split(",") if d.strip()]
        dynamic = any(p.startswith("<=") or p == "?" for p in parts)
        sizes = tuple(int(p.lstrip("<=")) if p != "?" else 0 for p in parts)
        arrays.append(Array(dtype, sizes, dynamic))
    return arrays


@dataclass
class Instruction:
    name: str
    opcode: str
    shape: list[Array]
    operands: list[str]
    attrs: str
    is_root: bool = False
    parameter_text: str = ""  # the number inside parameter(N)

    @property
    def parameter_number(self) -> int | None:
        return int(self.parameter_text) if self.opcode == "parameter" else None


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: dict[str, Instruction] = field(default_factory=dict)

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.is_root)

    def parameters(self) -> dict[int, Instruction]:
        return {i.parameter_number: i for i in self.instructions.values() if i.opcode == "parameter"}


@dataclass
class HloModule:
    name: str
    computations: dict[str, Computation]
    aliases: dict[int, int]  # output tuple index -> entry parameter number (input_output_alias)
    donors: set[int]  # entry parameter numbers declared buffer donors (XLA pairs them at compile)

    @property
    def entry(self) -> Computation:
        return next(c for c in self.computations.values() if c.is_entry)

    def outputs(self) -> list[Instruction]:
        """The entry's result elements (the operands of a ROOT tuple, or the root itself)."""
        root = self.entry.root
        if root.opcode == "tuple":
            return [self.entry.instructions[n] for n in root.operands]
        return [root]

    def all_instructions(self):
        for comp in self.computations.values():
            yield from comp.instructions.values()


def _operand_names(text: str) -> list[str]:
    """Operand names: '%a, %b' or typed 'f32[2] %a', or, in dumps printed without '%', 'f32[2] a'."""
    if "%" in text:
        return _NAME.findall(text)
    names, depth, token = [], 0, ""
    for ch in text + ",":
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            word = token.split()[-1] if token.split() else ""
            if re.fullmatch(r"[A-Za-z_][\w.\-]*", word):
                names.append(word)
            token = ""
        else:
            token += ch
    return names


def _split_instruction(line: str):
    """'[ROOT ]%name = SHAPE opcode(operands), attrs' -> parts, or None for other lines."""
    body = line.strip()
    is_root = body.startswith("ROOT ")
    body = body[5:] if is_root else body
    if " = " not in body:
        return None
    name, rest = body.split(" = ", 1)
    if rest.startswith("("):  # a tuple shape: up to its matching paren
        depth = 0
        for end, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[:end + 1], rest[end + 1:].strip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, paren, rest = rest.partition("(")
    if not paren:
        return None
    depth, end = 1, 0
    for end, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            break
    return is_root, name.strip().lstrip("%"), shape, opcode.strip(), rest[:end], rest[end + 1:]


def _parse_header(line: str) -> tuple[str, dict[int, int], set[int]]:
    name = line.split()[1].rstrip(",")
    aliases, donors = {}, set()
    if "input_output_alias=" in line:
        section = line.split("input_output_alias=", 1)[1]
        section = section[:section.index("entry_computation_layout")] if "entry_computation_layout" in section else section
        for out_index, param, _ in _ALIAS.findall(section):
            if out_index.strip():
                aliases[int(out_index.split(",")[0])] = int(param)
    if "buffer_donor=" in line:
        section = line.split("buffer_donor=", 1)[1]
        section = section[:section.index("entry_computation_layout")] if "entry_computation_layout" in section else section
        donors = {int(p) for p in re.findall(r"\((\d+),\s*\{", section)}
    return name, aliases, donors


def parse_hlo(text: str) -> HloModule:
    """Parse one HloModule's text."""
    name, aliases, donors = "", {}, set()
    computations: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("HloModule "):
            name, aliases, donors = _parse_header(stripped)
        elif stripped.endswith("{") and "=" not in stripped.split("(")[0]:
            is_entry = stripped.startswith("ENTRY ")
            comp_name = stripped.removeprefix("ENTRY ").split()[0].lstrip("%")
            current = computations.setdefault(comp_name, Computation(comp_name, is_entry))
        elif stripped == "}":
            current = None
        elif current is not None:
            parts = _split_instruction(stripped)
            if parts is None:
                continue
            is_root, inst_name, shape, opcode, operands, attrs = parts
            names = [] if opcode in ("parameter", "constant", "iota") else _operand_names(operands)
            inst = Instruction(inst_name, opcode, parse_shape(shape), names, attrs, is_root=is_root)
            if opcode == "parameter":
                inst.parameter_text = operands.strip()
            current.instructions[inst_name] = inst
    if not any(c.is_entry for c in computations.values()):
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(name, computations, aliases, donors)


def reaches(comp: Computation, start: str, target: str) -> bool:
    """True when instruction `start` depends (transitively, through operands) on `target`."""
    seen, stack = set(), [start]
    while stack:
        name = stack.pop()
        if name == target:
            return True
        if name in seen or name not in comp.instructions:
            continue
        seen.add(name)
        stack.extend(comp.instructions[name].operands)
    return False


def users(comp: Computation) -> dict[str, list[Instruction]]:
    """Instruction name -> the instructions that take it as an operand."""
    out: dict[str, list[Instruction]] = {}
    for inst in comp.instructions.values():
        for op in inst.operands:
            out.setdefault(op, []).append(inst)
    return out


def dot_flops(comp: Computation, inst: Instruction) -> int:
    """2 x output elements x contracted size of one `dot` (a multiply and an add per term)."""
    lhs = comp.instructions.get(inst.operands[0]) if inst.operands else None
    match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    if lhs is None or not match or not lhs.shape:
        return 0
    contracted = math.prod(lhs.shape[0].dims[int(d)] for d in match.group(1).split(",") if d)
    return 2 * inst.shape[0].elements * contracted
