"""Graph contracts: the port's device-graph properties, asserted on lowered HLO text from either lane.

The seed's fixes as properties of the graph, not of our intentions (docs/design.md#the-port): no softcap tanh over
a vocabulary-sized tensor; attention as plain dots in the activation dtype with an fp32 softmax and
no fused-attention custom call; static shapes and no host round trip; every KV cache an input
aliased to an output of the same shape and dtype, computed from that input; each graph writes
exactly its own positions' slots and reads the whole cache; per-rank weights in the sharding plan's
shapes. The checker reads HLO text (harness/hlo/ir.py) plus a signature naming what each entry
parameter is, so it runs on what torch-xla lowered on CPU (backends/xla.py) and on what was traced
for neuronx-cc on an inf2 host alike; what each graph must look like is harness/hlo/expectation.py.
It imports no SDK.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


from harness.hlo.expectation import HLO_DTYPES, Expectation, GraphSignature  # noqa: F401  (the checks' inputs)
from harness.hlo.ir import Computation, HloModule, Instruction, parse_hlo, reaches, users
FUSED_ATTENTION = re.compile(r"attention|attn|sdpa|flash|softmax|mha", re.IGNORECASE)
HOST_OPS = {"send", "recv", "send-done", "recv-done", "infeed", "outfeed"}
HOST_TARGETS = re.compile(r"host|callback|py_func", re.IGNORECASE)
PASS_THROUGH = {"copy", "bitcast", "reshape", "transpose", "get-tuple-element", "custom-call", "convert"}
CACHE_WRITES = {"scatter", "dynamic-update-slice"}


@dataclass
class Violation:
    contract: str
    detail: str

    def __str__(self) -> str:
        return f"{self.contract}: {self.detail}"


def _target(inst: Instruction) -> str:
    match = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
    return match.group(1) if match else ""


def _last2(inst: Instruction) -> tuple[int, ...]:
    return inst.shape[0].dims[-2:] if inst.shape else ()


# ---- the contracts --------------------------------------------------------------------------------

def softcap_off_device(module: HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """No tanh over a tensor with a vocabulary-sized dimension: the softcap stays on the host."""
    return [Violation("softcap_off_device", f"{i.name} is tanh over {i.shape[0].dtype}{list(i.shape[0].dims)}")
            for i in module.all_instructions()
            if i.opcode == "tanh" and i.shape and set(i.shape[0].dims) & exp.vocab_sizes]


def eager_attention(module: HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """Attention as plain dots: per layer a scores dot [.., s, keys] and a context dot reading
    [.., s, keys] probabilities, both in the activation dtype; an fp32 softmax; no fused call. `keys`
    is what the layer must read (Expectation.reads: its KV bucket, or a ring's window + s), and
    no attention-shaped dot reads more than the most any layer needs (a graph reads its bucket only)."""
    out = [Violation("eager_attention", f"{i.name} calls {_target(i)!r}") for i in module.all_instructions()
           if i.opcode == "custom-call" and FUSED_ATTENTION.search(_target(i))]
    entry = module.entry
    dots = [i for i in entry.instructions.values() if i.opcode == "dot"]
    for keys, layers in (exp.reads or {exp.max_len: exp.num_layers}).items():
        window = (exp.length, keys)
        scores = [d for d in dots if _last2(d) == window]
        context = [d for d in dots if d.operands and _last2(entry.instructions[d.operands[0]]) == window]
        for kind, found in (("scores", scores), ("context", context)):
            if len(found) < layers:
                out.append(Violation("eager_attention", f"{len(found)} {kind} dots over [.., {exp.length}, "
                                     f"{keys}] for {layers} layers"))
            out += [Violation("eager_attention", f"{kind} dot {d.name} in {d.shape[0].dtype}, not the activation "
                              f"dtype {exp.dtype} (an upcast fused/SDPA-style attention)")
                    for d in found if d.shape[0].dtype != exp.dtype]
        softmax = [i for i in entry.instructions.values() if i.opcode == "exponential" and _last2(i) == window
                   and i.shape[0].dtype == "f32"]
        if len(softmax) < layers:
            out.append(Violation("eager_attention", f"{len(softmax)} fp32 softmax exponentials over [.., "
                                 f"{exp.length}, {keys}] for {layers} layers"))
    most = max(exp.reads or {exp.max_len: 1})
    out += [Violation("eager_attention", f"softmax {i.name} reads {i.shape[0].dims[-1]} keys, more than the {most} "
                      "this graph needs") for i in entry.instructions.values()
            if i.opcode == "exponential" and i.shape and len(i.shape[0].dims) >= 3
            and i.shape[0].dims[-2] == exp.length and i.shape[0].dims[-1] > most]
    return out


def static_shapes(module: HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """Static shapes only and no host round trip inside the graph."""
    out = [Violation("static_shapes", f"{i.name} ({i.opcode}) has a dynamic shape {i.shape}")
           for i in module.all_instructions() if any(a.dynamic for a in i.shape)]
    out += [Violation("static_shapes", f"{i.name}: {i.opcode} {_target(i)} talks to the host")
            for i in module.all_instructions()
            if i.opcode in HOST_OPS or (i.opcode == "custom-call" and HOST_TARGETS.search(_target(i)))]
    if sig.host_transfers:
        out.append(Violation("static_shapes", f"tracing copied data to the host {sig.host_transfers} time(s) "
                             "mid-graph (data-dependent shapes or control flow)"))
    params = module.entry.parameters()
    want = {"inputs_embeds": (1, exp.length, exp.hidden), "positions": (1, exp.length)}
    for number, (role, name) in enumerate(sig.params):
        dims = params[number].shape[0].dims if number in params and params[number].shape else None
        if role == "input" and name in want and dims != want[name]:
            out.append(Violation("static_shapes", f"input {name} is {dims}, expected {want[name]}"))
        if role == "scalar" and dims:
            out.append(Violation("static_shapes", f"parameter {number} {list(dims)} is none of the graph's "
                                 "inputs, weights or state: data the host computed mid-graph"))
    return out


def _through(comp: Computation, name: str) -> Instruction:
    """Follow pass-through ops (copies, reshapes, sharding markers) down to the producing op."""
    inst = comp.instructions[name]
    while inst.opcode in PASS_THROUGH and len(inst.operands) == 1:
        inst = comp.instructions[inst.operands[0]]
    return inst


def _state_pairs(module: HloModule, sig: GraphSignature):
    """(name, parameter instruction, aliased output instruction or None) per state parameter."""
    params = module.entry.parameters()
    outputs = module.outputs()
    by_param = {p: o for o, p in module.aliases.items()}
    for number, (role, name) in enumerate(sig.params):
        if role == "state":
            out_index = by_param.get(number)
            yield name, params[number], (outputs[out_index] if out_index is not None and
                                         out_index < len(outputs) else None)


def kv_state_aliased(module: HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """Every KV cache is an input aliased to an output of the same shape and dtype, computed from it."""
    out = []
    names = {name for role, name in sig.params if role == "state"}
    for name in sorted(set(exp.kv_shapes) - names):
        out.append(Violation("kv_state_aliased", f"KV cache {name} is not an input of the graph "
                                 "(re-allocated inside it, or no state at all)"))
    for name, param, result in _state_pairs(module, sig):
        if result is None:
            out.append(Violation("kv_state_aliased", f"{name} (parameter {param.parameter_number}) is aliased "
                                 "to no output: the update is lost (an in-place update is not state)"))
        elif result.shape != param.shape:
            out.append(Violation("kv_state_aliased", f"{name}: output {result.shape} != input {param.shape}"))
        elif not reaches(module.entry, result.name, param.name):
            out.append(Violation("kv_state_aliased", f"{name}: the aliased output is not computed from the "
                                 "input cache (a re-allocated cache)"))
        if exp.kv_shapes.get(name) not in (None, param.shape[0].dims if param.shape else None):
            out.append(Violation("kv_state_aliased", f"{name} is {param.shape}, plan {exp.kv_shapes[name]}"))
    return out


def cache_writes_own_slots(module: HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """Each graph writes exactly its `length` slots into the cache it was given (decode: one slot)
    and reads the whole cache (no slice of it)."""
    out, entry = [], module.entry
    used_by = users(entry)
    for name, param, result in _state_pairs(module, sig):
        for user in used_by.get(param.name, []):
            if user.opcode in ("slice", "dynamic-slice"):
                out.append(Violation("cache_writes_own_slots", f"{name} is read through {user.opcode} {user.name}"))
        if result is None:
            continue
        write = _through(entry, result.name)
        if name in exp.rings and exp.length > 1:  # a ring's prefill: every slot selected between its prior key and a chunk row
            if write.opcode != "select" or not reaches(entry, write.name, param.name):
                out.append(Violation("cache_writes_own_slots", f"{name}: ring produced by {write.opcode}, not a "
                                     "select over the input ring"))
            continue
        if write.opcode not in CACHE_WRITES:
            out.append(Violation("cache_writes_own_slots", f"{name} is produced by {write.opcode}, not a slot write"))
            continue
        update = entry.instructions[write.operands[2 if write.opcode == "scatter" else 1]]
        row = param.shape[0].elements // max(param.shape[0].dims[2], 1)  # [b, heads, slots, d]: one slot's elements
        slots = update.shape[0].elements // max(row, 1)  # (decode: one slot, a ring's too)
        if slots != exp.length or _through(entry, write.operands[0]).name != param.name:
            out.append(Violation("cache_writes_own_slots", f"{name}: {write.opcode} writes {slots} slot(s) of the "
                                 f"{'input cache' if _through(entry, write.operands[0]).name == param.name else 'another buffer'}"
                                 f", expected {exp.length} of the input cache"))
    return out


def rank_weight_shapes(module: HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """Per-rank weights enter the graph in exactly the sharding plan's shapes."""
    params = module.entry.parameters()
    seen, out = set(), []
    for number, (role, name) in enumerate(sig.params):
        if role != "weight":
            continue
        seen.add(name)
        dims = params[number].shape[0].dims
        if exp.weight_shapes.get(name) != dims:
            out.append(Violation("rank_weight_shapes", f"{name} enters as {list(dims)}, plan "
                                 f"{exp.weight_shapes.get(name, 'has no such weight')}"))
    for name in sorted(set(exp.weight_shapes) - seen):
        out.append(Violation("rank_weight_shapes", f"plan weight {name} is not an input of the graph"))
    return out


def target_kv_read_only(module: HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """A draft graph (harness/backends/xla_drafter.py) reads the target's KV states it names
    (`exp.kv_shapes`, parameters of role target_kv, in those shapes) and writes none: none is aliased
    to an output or the base of a slot write; and it holds no cache of its own (no state)."""
    out, entry = [], module.entry
    params, aliased = entry.parameters(), set(module.aliases.values())
    seen = {name for role, name in sig.params if role == "target_kv"}
    out += [Violation("target_kv_read_only", f"the target's KV {name} is not an input of the draft graph")
            for name in sorted(set(exp.kv_shapes) - seen)]
    writes = [i for i in entry.instructions.values() if i.opcode in CACHE_WRITES]
    for number, (role, name) in enumerate(sig.params):
        if role == "state" or (role == "target_kv" and number in aliased):
            out.append(Violation("target_kv_read_only", f"{name} (parameter {number}) is aliased to an output: "
                                 "the draft graph writes a cache"))
        if role != "target_kv":
            continue
        dims = params[number].shape[0].dims if params[number].shape else None
        if exp.kv_shapes.get(name) not in (None, dims):
            out.append(Violation("target_kv_read_only", f"{name} enters as {dims}, plan {exp.kv_shapes[name]}"))
        out += [Violation("target_kv_read_only", f"{name} is written by {w.opcode} {w.name}")
                for w in writes if _through(entry, w.operands[0]).name == params[number].name]
    return out


def check_draft_graph(hlo: str | HloModule, sig: GraphSignature, exp: Expectation) -> list[Violation]:
    """The contracts of a draft graph (draft_expectation): no softcap on the device, eager attention,
    static shapes and no host round trip, the target's KV read only, weights in the rank's shapes."""
    module = hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)
    if len(module.entry.parameters()) != len(sig.params):
        return [Violation("signature", f"HLO has {len(module.entry.parameters())} parameters, the signature "
                          f"names {len(sig.params)}")]
    return [v for contract in (softcap_off_device, eager_attention, static_shapes, target_kv_read_only,
                               rank_weight_shapes) for v in contract(module, sig, exp)]


CONTRACTS = {f.__name__: f for f in (softcap_off_device, eager_attention, static_shapes, kv_state_aliased,
                                     cache_writes_own_slots, rank_weight_shapes)}


def check_graph(hlo: str | HloModule, sig: GraphSignature, exp: Expectation, only=None) -> list[Violation]:
    """Every contract (or those named in `only`) on one lowered graph; [] when all hold."""
    module = hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)
    if len(module.entry.parameters()) != len(sig.params):
        return [Violation("signature", f"HLO has {len(module.entry.parameters())} parameters, the signature "
                          f"names {len(sig.params)}")]
    return [v for name, contract in CONTRACTS.items() if only is None or name in only
            for v in contract(module, sig, exp)]


@dataclass
class GraphStats:
    ops: dict[str, int] = field(default_factory=dict)
    dot_flops: int = 0
    weight_bytes: int = 0
    constant_bytes: int = 0
    state_bytes: int = 0
    returned_bytes: int = 0
    collectives: dict[str, int] = field(default_factory=dict)


def graph_stats(hlo: str | HloModule, sig: GraphSignature) -> GraphStats:
    """Counts from one lowered graph: entry ops by opcode; matmul FLOPs (2 x output elements x
    contracted size per dot; elementwise work not counted); bytes of weight, constant and KV-state
    parameters (each read once per call); bytes of the outputs not aliased to state (returned to
    the host per call); collectives by opcode."""
    from harness.hlo.ir import dot_flops

    module = hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)
    entry, stats = module.entry, GraphStats()
    for inst in entry.instructions.values():
        stats.ops[inst.opcode] = stats.ops.get(inst.opcode, 0) + 1
        if inst.opcode == "dot":
            stats.dot_flops += dot_flops(entry, inst)
        if inst.opcode in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
            stats.collectives[inst.opcode] = stats.collectives.get(inst.opcode, 0) + 1
    params = entry.parameters()
    for number, (role, _) in enumerate(sig.params):
        size = sum(a.bytes for a in params[number].shape)
        if role in ("weight", "constant", "state"):
            setattr(stats, f"{role}_bytes", getattr(stats, f"{role}_bytes") + size)
    aliased = set(module.aliases)
    stats.returned_bytes = sum(sum(a.bytes for a in o.shape) for k, o in enumerate(module.outputs()) if k not in aliased)
    stats.ops = dict(sorted(stats.ops.items()))
    return stats
