"""Faults planted in a bundle's HLO text, stand-ins for a miscompile (docs/snapshot.md#the-hlo-bundle):
an operand swapped, a constant changed, a reduction's accumulation type narrowed. The planted text
becomes the bundle's `test_module` (what the cpu run executes in place of the module); the expected
outputs stay the clean module's reference run, so check.sh exits 1 and names the outputs that moved."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from harness.bundle import hlo_text
from harness.bundle.write import readme, sha256_bytes

KINDS = ("swap", "constant", "narrow")
PLANTED = "planted.hlo.txt"


def _swap(m: hlo_text.HloText) -> str:
    """The operands of the entry's last subtract whose two operands differ (a - b -> b - a)."""
    for inst in reversed(m.entry):
        if inst.opcode in ("subtract", "divide") and len(set(inst.operands)) == 2:
            a, b = inst.operands
            head, _, rest = inst.line.partition(f"{inst.opcode}(")
            args, close, tail = rest.partition(")")
            swapped = re.sub(rf"%{re.escape(a)}\b", "%\0A", args)
            swapped = re.sub(rf"%{re.escape(b)}\b", f"%{a}", swapped).replace("%\0A", f"%{b}")
            inst.line, inst.operands = f"{head}{inst.opcode}({swapped}){tail}", [b, a]
            return f"operands of %{inst.name} ({inst.opcode}) swapped"
    raise ValueError("no subtract or divide with two distinct operands to swap")


def _constant(m: hlo_text.HloText) -> str:
    """The last scalar floating constant other than 0, 1 and infinities, plus 1 (or doubled when large)."""
    users = {op for i in m.entry for op in i.operands}
    for inst in reversed(m.entry):
        match = re.search(r"constant\(([-\d.e+]+)\)", inst.line)
        if inst.opcode != "constant" or not match or inst.shape.split("[")[0] not in ("f32", "bf16", "f16") \
                or inst.name not in users:
            continue
        value = float(match.group(1))
        if value in (0.0, 1.0, -1.0):
            continue
        new = value + 1.0 if abs(value) < 1 else value * 2.0
        inst.line = inst.line.replace(f"constant({match.group(1)})", f"constant({new!r})")
        return f"constant %{inst.name} changed from {value!r} to {new!r}"
    raise ValueError("no scalar floating constant to change")


def _narrow(m: hlo_text.HloText) -> str:
    """Every f32 add-reduction over the most elements accumulated in bf16 instead (each result widened
    back, so every user sees the same shape), as a compiler that picks bf16 accumulation for a pattern
    would: one such reduction alone can be cancelled downstream (an RMSNorm's sum of squares before
    q/k/v norms only scales rows the next norm rescales), all of them cannot."""
    sized = []
    for inst in m.entry:
        if inst.opcode != "reduce" or not inst.shape.startswith("f32") or len(inst.operands) != 2:
            continue
        comp = next(iter(hlo_text.called(inst.line)), None)
        if comp is None or not any(" add(" in line for line in m.computations.get(comp, [])):
            continue
        sized.append((eval_size(m.inst(inst.operands[0]).shape) // max(eval_size(inst.shape), 1), inst))
    if not sized:
        raise ValueError("no f32 add-reduction to narrow")
    most = max(size for size, _ in sized)
    m.computations["narrowed.add"] = ["%narrowed.add (x: bf16[], y: bf16[]) -> bf16[] {", "  %x = bf16[] parameter(0)",
                                      "  %y = bf16[] parameter(1)", "  ROOT %s = bf16[] add(%x, %y)", "}"]
    names = [inst.name for size, inst in sized if size == most]
    for inst in [inst for size, inst in sized if size == most]:
        _narrow_one(m, inst)
    return (f"reduce {', '.join('%' + n for n in names)} (over {most} elements per output) accumulated in bf16 "
            "instead of f32")


def _narrow_one(m: hlo_text.HloText, inst: hlo_text.Inst) -> None:
    data, init = inst.operands
    in_shape = "bf16" + m.inst(data).shape[3:]
    out_shape = "bf16" + inst.shape[3:]
    attrs = inst.line.split(")", 1)[1].replace(f"to_apply=%{next(iter(hlo_text.called(inst.line)))}",
                                                 "to_apply=%narrowed.add")
    index = m.entry.index(inst)
    n = inst.name
    new = [hlo_text.Inst(f"{n}.in", in_shape, "convert", [data], f"%{n}.in = {in_shape} convert(%{data})"),
           hlo_text.Inst(f"{n}.init", "bf16[]", "convert", [init], f"%{n}.init = bf16[] convert(%{init})"),
           hlo_text.Inst(f"{n}.bf16", out_shape, "reduce", [f"{n}.in", f"{n}.init"],
                         f"%{n}.bf16 = {out_shape} reduce(%{n}.in, %{n}.init){attrs}"),
           hlo_text.Inst(n, inst.shape, "convert", [f"{n}.bf16"], f"%{n} = {inst.shape} convert(%{n}.bf16)")]
    m.entry[index:index + 1] = new


def eval_size(shape: str) -> int:
    dims = re.match(r"\w+\[([\d,]*)\]", shape)
    size = 1
    for d in (dims.group(1).split(",") if dims and dims.group(1) else []):
        size *= int(d)
    return size


def plant(text: str, kind: str) -> tuple[str, str]:
    """(planted text, what was planted)."""
    m = hlo_text.parse(text)
    what = {"swap": _swap, "constant": _constant, "narrow": _narrow}[kind](m)
    return hlo_text.render(m), what


def plant_bundle(bundle, out_dir, kind: str) -> str:
    """A copy of `bundle` whose test module is its module with fault `kind` planted."""
    bundle, out_dir = Path(bundle), Path(out_dir)
    manifest = json.loads((bundle / "bundle.json").read_text())
    planted, what = plant((bundle / manifest["module"]["text"]).read_text(), kind)
    shutil.copytree(bundle, out_dir)
    (out_dir / PLANTED).write_text(planted)
    manifest["test_module"], manifest["planted"] = PLANTED, what
    manifest["files"][PLANTED] = sha256_bytes(planted.encode())
    (out_dir / "README.md").write_text(readme(manifest))
    (out_dir / "bundle.json").write_text(json.dumps(manifest, indent=1))
    return what
