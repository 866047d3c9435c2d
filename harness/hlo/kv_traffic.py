"""The KV-traffic contract: the KV cache bytes one lowered graph reads and writes, against a bound
from the rows the call touches (batch, KV bucket, new rows), not from the cache's size.

A batched graph (harness/port/kv_slots.py) scatters each row's new keys into its slot and reads back
only its slot's KV bucket (a ring: its slot's ring); NxD Inference's KV cache manager does the same.
Per KV state parameter of `[slots, kv_heads, len, d]`, with `row` = kv_heads x d elements:
- written: the updates of the scatters (or dynamic-update-slices) chained from the parameter to its
  aliased output; an output produced any other way rewrites the whole buffer. Bound:
  batch x min(new rows, len) x row.
- read: every gather or slice of the parameter or of a cache value on that chain (their outputs),
  and the whole value for any other op that takes it (a select or concatenate over the cache reads
  all of it). Bound: batch x (KV bucket + new rows) x row (the bucket's keys, and the rows a write
  looks at first).
Reads HLO text through harness/hlo/ir.py; imports no SDK.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.hlo.ir import HloModule, parse_hlo, users
from harness.port.sharding import plan_model, ring_windows

# ops that hand the same cache bytes on (a view, a sharding marker). A `copy` or `convert` of the
# cache is not one: it materialises every row (another layout or dtype), so it reads the cache whole
# and, on the way to the aliased output, rewrites it whole.
VIEWS = {"reshape", "bitcast", "custom-call", "get-tuple-element"}
ROW_READS = {"gather", "slice", "dynamic-slice"}
ROW_WRITES = {"scatter": 2, "dynamic-update-slice": 1}  # opcode -> operand index of the written rows


@dataclass(frozen=True)
class KvBound:
    """Bytes one KV buffer may move in one call of a graph."""
    read: int
    write: int


@dataclass(frozen=True)
class KvTraffic:
    read: int
    write: int
    whole_writes: tuple[str, ...] = ()  # ops that produce the cache without a row write


def kv_bounds(spec, tp: int, max_len: int, length: int, batch: int, kv_read: int, nbytes: int,
              sliding_cache: str = "linear", rank: int = 0) -> dict[str, KvBound]:
    """Per KV buffer of one rank's graph of `batch` rows and `length` new positions reading the KV
    bucket `kv_read` (a ring reads its window): the bytes it may read and write."""
    windows = ring_windows(spec, sliding_cache, max_len)
    out = {}
    for layer, plan in zip(spec.layers, plan_model(spec, tp)):
        if layer.kv_source is not None:
            continue  # a KV-shared layer holds no cache
        row = plan.kv_heads_per_rank * layer.head_dim * nbytes
        keys = windows.get(layer.index, max_len)
        read_keys = keys if layer.index in windows else min(kv_read, max_len)
        for buf in ("k", "v"):
            out[f"layers.{layer.index}.self_attn.cache.{buf}"] = KvBound(
                read=batch * (read_keys + length) * row, write=batch * min(length, keys) * row)
    return out


def _nbytes(inst) -> int:
    return sum(a.bytes for a in inst.shape)


def measure(module: HloModule, param_name: str, output_name: str | None) -> KvTraffic:
    """The KV bytes read and written through one state parameter (module docstring)."""
    entry = module.entry
    used_by = users(entry)
    chain, write, whole = {param_name}, 0, []
    node = output_name
    while node is not None and node != param_name:  # from the aliased output back to the parameter
        inst = entry.instructions[node]
        if inst.opcode in VIEWS and len(inst.operands) == 1:
            chain.add(node)
            node = inst.operands[0]
        elif inst.opcode in ROW_WRITES:
            chain.add(node)
            write += _nbytes(entry.instructions[inst.operands[ROW_WRITES[inst.opcode]]])
            node = inst.operands[0]
        else:
            whole.append(f"{inst.opcode} {inst.name}")
            write += _nbytes(entry.instructions[param_name])
            break
    read, stack, seen = 0, [param_name], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for user in used_by.get(name, []):
            if user.opcode in VIEWS and len(user.operands) == 1:
                stack.append(user.name)
            elif user.opcode in ROW_WRITES and user.operands[0] == name:
                stack.append(user.name)  # the cache with rows written: read on from it
            elif user.opcode in ROW_READS and user.operands[0] == name:
                read += _nbytes(user)
            elif user.opcode != "tuple":
                read += _nbytes(entry.instructions[name])
    return KvTraffic(read=read, write=write, whole_writes=tuple(whole))


def kv_traffic(hlo: str | HloModule, params: list[tuple[str, str]], bounds: dict[str, KvBound]) -> list[str]:
    """Violations (text) of the bound on every KV state parameter of one lowered graph; [] when
    each reads and writes within it. `params`: per entry parameter (role, name), as a
    GraphSignature's; the aliases in the HLO header pair each state with its output."""
    module = hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)
    entry_params, outputs = module.entry.parameters(), module.outputs()
    output_of = {p: outputs[o].name for o, p in module.aliases.items() if o < len(outputs)}
    out = []
    for number, (role, name) in enumerate(params):
        if role != "state" or name not in bounds:
            continue
        got, bound = measure(module, entry_params[number].name, output_of.get(number)), bounds[name]
        if got.read > bound.read:
            out.append(f"{name} reads {got.read} bytes, bound {bound.read} (batch x (KV bucket + new rows))")
        if got.write > bound.write:
            how = f" (rewritten whole by {', '.join(got.whole_writes)})" if got.whole_writes else ""
            out.append(f"{name} writes {got.write} bytes{how}, bound {bound.write} (batch x new rows)")
    missing = sorted(set(bounds) - {n for r, n in params if r == "state"})
    out += [f"KV buffer {n} is not a state parameter of the graph" for n in missing]
    return out
