"""The HLO text reader and the graph contracts on hand-written HLO (no torch-xla needed): what the
checker reads from a module is what the text says, and a graph the contracts forbid is caught."""

from __future__ import annotations

import pytest

from harness.hlo.contracts import Expectation, GraphSignature, check_graph, graph_stats
from harness.hlo.ir import dot_flops, parse_hlo, parse_shape

# One rank's decode graph of a 1-layer model: hidden 4, 2 heads of dim 2, KV length 8, vocab 6.
DECODE = """HloModule toy, input_output_alias={ {1}: (2, {}, may-alias) }, entry_computation_layout={(bf16[1,1,4]{2,1,0}, s32[1,1]{1,0}, bf16[1,1,8,2]{3,2,1,0}, bf16[6,4]{1,0})->(bf16[1,1,6]{2,1,0}, bf16[1,1,8,2]{3,2,1,0})}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p0: bf16[1,1,4], p1: s32[1,1], p2: bf16[1,1,8,2], p3: bf16[6,4]) -> (bf16[1,1,6], bf16[1,1,8,2]) {
  %p0 = bf16[1,1,4]{2,1,0} parameter(0)
  %p1 = s32[1,1]{1,0} parameter(1)
  %p2 = bf16[1,1,8,2]{3,2,1,0} parameter(2)
  %p3 = bf16[6,4]{1,0} parameter(3)
  %r = bf16[1,1,1,2]{3,2,1,0} reshape(bf16[1,1,4]{2,1,0} %p0)
  %upd = bf16[1,1,8,2]{3,2,1,0} dynamic-update-slice(bf16[1,1,8,2]{3,2,1,0} %p2, bf16[1,1,1,2]{3,2,1,0} %r, s32[] %c0, s32[] %c0, s32[] %c0, s32[] %c0)
  %q = bf16[2,1,2]{2,1,0} reshape(bf16[1,1,4]{2,1,0} %p0)
  %kt = bf16[2,2,8]{2,1,0} broadcast(bf16[1,1,8,2]{3,2,1,0} %upd), dimensions={}
  %scores = bf16[2,1,8]{2,1,0} dot(bf16[2,1,2]{2,1,0} %q, bf16[2,2,8]{2,1,0} %kt), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %sf = f32[2,1,8]{2,1,0} convert(bf16[2,1,8]{2,1,0} %scores)
  %e = f32[2,1,8]{2,1,0} exponential(f32[2,1,8]{2,1,0} %sf)
  %pr = bf16[2,1,8]{2,1,0} convert(f32[2,1,8]{2,1,0} %e)
  %vv = bf16[2,8,2]{2,1,0} broadcast(bf16[1,1,8,2]{3,2,1,0} %upd), dimensions={}
  %ctx = bf16[2,1,2]{2,1,0} dot(bf16[2,1,8]{2,1,0} %pr, bf16[2,8,2]{2,1,0} %vv), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %h = bf16[1,4]{1,0} reshape(bf16[2,1,2]{2,1,0} %ctx)
  %lg = bf16[1,6]{1,0} dot(bf16[1,4]{1,0} %h, bf16[6,4]{1,0} %p3), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %logits = bf16[1,1,6]{2,1,0} reshape(bf16[1,6]{1,0} %lg)
  ROOT %out = (bf16[1,1,6]{2,1,0}, bf16[1,1,8,2]{3,2,1,0}) tuple(bf16[1,1,6]{2,1,0} %logits, bf16[1,1,8,2]{3,2,1,0} %upd)
}
"""
SIG = GraphSignature([("input", "inputs_embeds"), ("input", "positions"), ("state", "cache.k"), ("weight", "lm_head.weight")],
                     ["logits", "cache.k"], host_transfers=0)
EXP = Expectation(length=1, max_len=8, hidden=4, num_layers=1, dtype="bf16", vocab_sizes=frozenset({6, 3}),
                  weight_shapes={"lm_head.weight": (6, 4)}, kv_shapes={"cache.k": (1, 1, 8, 2)})


def test_reader_sees_header_parameters_outputs_and_shapes():
    module = parse_hlo(DECODE)
    assert module.name == "toy" and module.aliases == {1: 2} and module.donors == set()
    assert sorted(module.entry.parameters()) == [0, 1, 2, 3]
    assert [o.name for o in module.outputs()] == ["logits", "upd"]
    assert module.entry.instructions["upd"].operands[:2] == ["p2", "r"]
    assert parse_shape("(f32[2,<=3]{1,0}, s32[])")[0].dynamic and parse_shape("bf16[2,3]")[0].bytes == 12


def test_dot_flops_and_stats():
    module = parse_hlo(DECODE)
    entry = module.entry
    assert dot_flops(entry, entry.instructions["scores"]) == 2 * (2 * 1 * 8) * 2
    stats = graph_stats(module, SIG)
    assert stats.dot_flops == 64 + 2 * 2 * 2 * 8 + 2 * 6 * 4
    assert stats.weight_bytes == 48 and stats.state_bytes == 32 and stats.returned_bytes == 12


def test_the_toy_decode_graph_meets_the_contracts():
    assert check_graph(DECODE, SIG, EXP) == []


@pytest.mark.parametrize("edit, contract", [
    (("ROOT %out = (bf16[1,1,6]{2,1,0}, bf16[1,1,8,2]{3,2,1,0}) tuple(bf16[1,1,6]{2,1,0} %logits,",
      "%t = bf16[1,1,6]{2,1,0} tanh(bf16[1,1,6]{2,1,0} %logits)\n  ROOT %out = (bf16[1,1,6]{2,1,0}, bf16[1,1,8,2]{3,2,1,0}) tuple(bf16[1,1,6]{2,1,0} %t,"),
     "softcap_off_device"),
    (("input_output_alias={ {1}: (2, {}, may-alias) }, ", ""), "kv_state_aliased"),
    (("%scores = bf16[2,1,8]", "%scores = f32[2,1,8]"), "eager_attention"),
    (("%p1 = s32[1,1]{1,0}", "%p1 = s32[1,<=1]{1,0}"), "static_shapes"),
    (("%r = bf16[1,1,1,2]", "%r = bf16[1,1,2,2]"), "cache_writes_own_slots"),
    (("%p3 = bf16[6,4]{1,0} parameter(3)", "%p3 = bf16[3,4]{1,0} parameter(3)"), "rank_weight_shapes"),
])
def test_each_forbidden_edit_is_caught(edit, contract):
    old, new = edit
    assert old in DECODE
    found = {v.contract for v in check_graph(DECODE.replace(old, new), SIG, EXP)}
    assert found == {contract}, (contract, found)


def test_a_parameter_the_signature_does_not_name_is_refused():
    text = DECODE.replace("%p3 = bf16[6,4]{1,0} parameter(3)", "%p3 = bf16[6,4]{1,0} parameter(3)\n  %p4 = f32[] parameter(4)")
    assert [v.contract for v in check_graph(text, SIG, EXP)] == ["signature"]


def test_text_printed_without_percent_signs_reads_the_same():
    """Some XLA dumps print names without '%': the reader sees the same graph and contracts."""
    bare = parse_hlo(DECODE.replace("%", ""))
    assert bare.entry.instructions["upd"].operands[:2] == ["p2", "r"]
    assert bare.entry.instructions["ctx"].operands == ["pr", "vv"]
    assert check_graph(DECODE.replace("%", ""), SIG, EXP) == []
    assert graph_stats(bare, SIG).dot_flops == graph_stats(DECODE, SIG).dot_flops
