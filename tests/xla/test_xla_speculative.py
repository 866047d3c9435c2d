"""Speculative decoding on the XLA backend (docs/speculative.md): the drafter as one SPMD program per
draft step (harness/backends/xla_drafter.py) reading the target's device KV state, the verify graph
a compiled bucket. On the fitted tiny pairs (the unified 12B-like and the gemma4 family's 31B,
harness/reference/tiny_assistant.py, as tests/faults/test_speculate_faults.py builds them) the
speculative stage of `check` passes at TP 1 and 2 (one of them through the `check` command line);
a drafter fault fails it naming the drafter's point; the draft graph keeps its HLO contracts (no
host round trip, the target's KV read only) and each contract fails on a deliberate violation."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from harness.base.settings import RunSettings
from tests.faults.test_speculate_faults import PROMPTS as FAULT_PROMPTS
from types import SimpleNamespace

pytestmark = pytest.mark.xla
K = 3
PROMPTS = FAULT_PROMPTS[:2]  # the lane's time goes to compiling (a few graphs per engine), not to prompts
NEW_TOKENS = 8


@functools.lru_cache(maxsize=None)
def pair(name: str):
    """(target Checkpoint, assistant dir, references of PROMPTS) of a fitted tiny pair (cached on disk)."""
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY
    from harness.reference.run import run_reference
    from harness.reference.tiny_assistant import tiny_assistant

    target, assistant = tiny_assistant(0, TINY_CONFIG if name == "12b" else TINY_FAMILY["31b"])
    return Checkpoint.open(target), assistant, run_reference(target, PROMPTS, NEW_TOKENS)


def _stage(name: str, tp: int, dtype: str = "bfloat16", batch: int = 1):
    from harness.parity.speculative import check_speculative

    ckpt, assistant, refs = pair(name)
    ref32, ref16 = refs["float32"], refs["bfloat16"]
    settings = RunSettings(backend="xla", tp=tp, dtype=dtype, buckets=(16, 64), kv_len=64, batch=batch)
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint

    return check_speculative(ckpt, ref32, ref16, SimpleNamespace(band=4.0), settings=settings,
                             assistant=AssistantCheckpoint.open(assistant, ckpt.spec), k=K)


@pytest.mark.parametrize("name, tp", [("12b", 1), ("31b", 1), ("31b", 2)])
def test_the_speculative_stage_passes_on_xla(name, tp):
    stage = _stage(name, tp)
    assert stage.error is None and stage.passed, stage.describe()
    assert len(stage.drafter_points) == 2 * 9  # bf16 and fp32, nine points each (state_fed included)
    assert all(a["port"] >= a["reference"] - a["band"] for a in stage.acceptance)


def test_the_speculative_stage_passes_in_a_batch_on_xla():
    """`check --batch 2 --assistant A --speculate 3 --backend xla`'s stage: both prompts served as one
    batch of two KV slots, each sequence drafting from its own slot (XlaDrafter.serves_slots), one
    batched verify call a round; greedy tokens the target's own, acceptance judged per sequence."""
    stage = _stage("12b", 1, batch=2)
    assert stage.error is None and stage.passed, stage.describe()
    assert [a["prompt"] for a in stage.acceptance] == list(range(len(PROMPTS)))
    assert all(a["passed"] and a["verifies"] > 0 for a in stage.acceptance), stage.acceptance


def test_bench_speculates_in_a_batch_on_xla(tmp_path, capsys):
    """`bench --batch 1,2 --assistant A --speculate 3 --backend xla` on the mirror pair: the batched
    perf build (last-row prefill, its verify graph returning every row and the final-norm states)
    speculates, each sequence's tokens its plain greedy decode's, and reports the accepted drafts per
    verify of each batch, per sequence: the cpu backend's figures, sequence for sequence (the first
    sequence's the same alone and beside another)."""
    from harness.cli import main
    from harness.reference.mirror_assistant import mirror_pair

    target, assistant = mirror_pair(0)

    def bench(backend: str) -> dict:
        out = tmp_path / f"{backend}.json"
        code = main(["bench", "--checkpoint", str(target), "--backend", backend, "--tp", "1", "--assistant", str(assistant),
                     "--speculate", str(K), "--batch", "1,2", "--runs", "1", "--warmup", "0", "--new-tokens", "8",
                     "--buckets", "16", "--kv-len", "32", "--out", str(out)])
        assert code == 0, capsys.readouterr().err[-2000:]
        return {r["batch"]: r["speculative"] for r in json.loads(out.read_text())["batch"]["rows"]}

    rows, cpu = bench("xla"), bench("cpu")
    assert sorted(rows) == [1, 2]
    for b, s in rows.items():
        assert s["tokens_equal"] and s["k"] == K and len(s["per_sequence"]) == b and s["verifies"] > 0, s
        assert s["per_sequence"] == cpu[b]["per_sequence"] and s["verifies"] == cpu[b]["verifies"], (s, cpu[b])
    assert rows[2]["per_sequence"][0] == rows[1]["per_sequence"][0] and max(rows[2]["per_sequence"]) > 1.0


def test_check_with_the_assistant_passes_on_xla_at_tp2(tmp_path, capsys):
    """`check --checkpoint T --assistant A --speculate 3 --backend xla --tp 2` on the 12B-like pair."""
    from harness.cli import main

    ckpt, assistant, _ = pair("12b")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "check.json"
    code = main(["check", "--backend", "xla", "--tp", "2", "--checkpoint", str(ckpt.path), "--assistant",
                 str(assistant), "--speculate", str(K), "--prompts", str(prompts), "--new-tokens", str(NEW_TOKENS),
                 "--buckets", "16", "--kv-len", "64", "--skip-served-build", "--batch", "1", "--json", str(out)])
    # --batch 1: no batch stage here (speculation is this test's subject; the default check's batch
    # stage on xla runs in test_xla_backend's check)
    text = capsys.readouterr().out
    assert code == 0, text
    stage = json.loads(out.read_text())["extra_stages"]["speculative"]
    assert stage["passed"] and stage["k"] == K and len(stage["acceptance"]) == len(PROMPTS)
    assert "speculative decoding (k=3): PASS" in text


def test_a_drafter_fault_fails_the_stage_on_xla_naming_its_point(monkeypatch):
    """The faults catalog's "drafter reads the wrong layer's KV", on the xla drafter: each layer reads
    the device cache of the first target layer of its store layer's type. The drafter's first
    layer fails (fp32 only: the cheaper run). (The catalog's swapped-inputs fault cannot be injected
    here once the healthy draft graph ran in the process: torch-xla reuses the compiled program for
    the structurally equal graph with its two same-shaped inputs swapped, and computes the healthy
    order.)"""
    from harness.backends import xla_drafter
    from harness.parity.speculative import first_drafter_point

    original = xla_drafter.kv_state_names

    def wrong_layer(aspec):
        target = pair("12b")[0].spec
        first = {layer.type: layer.index for layer in reversed(target.layers)}
        return [tuple(n.replace(f"layers.{layer.kv_source}.", f"layers.{first[target.layers[layer.kv_source].type]}.")
                      for n in names) for layer, names in zip(aspec.layers, original(aspec))]
    monkeypatch.setattr(xla_drafter, "kv_state_names", wrong_layer)
    stage = _stage("12b", 2, dtype="float32")
    assert not stage.passed and stage.error is None, stage.describe()
    assert first_drafter_point(stage)["point"] == "fp32.drafter.layers.0.output"


# ---- the draft graph's HLO contracts --------------------------------------------------------------

def _lowered(tp: int = 2):
    from harness.backends import build_drafter, build_engine
    from harness.hlo.expectation import GraphSignature, draft_expectation
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint

    ckpt, assistant_dir, _ = pair("12b")
    settings = RunSettings(backend="xla", tp=tp, dtype="bfloat16", buckets=(16,), kv_len=64, speculate=K)
    engine = build_engine(ckpt, settings)
    drafter = build_drafter(engine, AssistantCheckpoint.open(assistant_dir, ckpt.spec))
    graph = drafter.lower(rank=0)
    shapes = {n: tuple(t.shape) for n, t in drafter.weights_of(0).items()}
    exp = draft_expectation(drafter.spec, ckpt.spec, tp, settings.kv_len, settings.torch_dtype, shapes)
    return graph, GraphSignature(graph.params, graph.outputs, graph.host_transfers), exp


def test_the_draft_graph_keeps_its_contracts():
    from harness.hlo.contracts import check_draft_graph

    graph, sig, exp = _lowered()
    assert check_draft_graph(graph.hlo, sig, exp) == []
    kv = [name for role, name in graph.params if role == "target_kv"]
    assert sorted(kv) == sorted(exp.kv_shapes) and len(kv) == 4  # the sliding and the full store layer's k, v
    assert "all-reduce" in graph.hlo  # the MLP's row-parallel projection, in the graph


def _writes_the_target_cache(module, embeds, hidden, position, kv, capture):
    outputs, names = ORIGINAL(module, embeds, hidden, position, kv, capture)
    k = kv[0][0]
    written = k.index_copy(2, position.reshape(-1).to(torch.long), torch.ones_like(k[:, :, :1]))
    return outputs + [written], names + ["written"]


def _host_round_trip(module, embeds, hidden, position, kv, capture):
    step = int(position.reshape(-1)[0].cpu())  # data-dependent: the position read back on the host
    return ORIGINAL(module, embeds, hidden, torch.full_like(position, step), kv, capture)


@pytest.mark.parametrize("fault, contract", [(_writes_the_target_cache, "target_kv_read_only"),
                                             (_host_round_trip, "static_shapes")], ids=["writes", "host"])
def test_each_draft_contract_fails_on_a_violation(monkeypatch, fault, contract):
    from harness.backends import xla_drafter
    from harness.hlo.contracts import check_draft_graph

    global ORIGINAL
    ORIGINAL = xla_drafter.draft_forward
    monkeypatch.setattr(xla_drafter, "draft_forward", fault)
    graph, sig, exp = _lowered()
    found = {v.contract for v in check_draft_graph(graph.hlo, sig, exp)}
    assert contract in found, found


ORIGINAL = None


@pytest.mark.parametrize("tp", [1, 2])
def test_the_perf_builds_verify_graph_keeps_the_graph_contracts(tiny_spec, tp):
    """The verify graph of a perf build (traced without last_index): every row's logits and the
    final-norm states returned, its k+1 slots written, the KV cache aliased state, every contract."""
    from harness.backends.xla_lower import build_graph_module, graph_tensors, lower_graph
    from harness.hlo.contracts import GraphSignature, check_graph
    from harness.hlo.expectation import expectation_for
    from harness.hlo.ir import parse_hlo
    from harness.port.graphs import graph_plan

    tag = next(t for t in graph_plan((16,), 64, speculate=K) if t.startswith("verify"))
    module = build_graph_module(tiny_spec, tp, 64, torch.bfloat16)  # a perf build (last_row_only)
    tensors, roles = graph_tensors(module)
    graph = lower_graph(module, tensors, roles, tag, K + 1)
    assert [role for role, _ in graph.params if role == "input"] == ["input", "input"]  # no last_index
    assert graph.outputs[:2] == ["logits", "output1"]  # the logits and the final-norm states
    logits, hidden = (o.shape[0].dims for o in parse_hlo(graph.hlo).outputs()[:2])
    assert logits == (1, K + 1, tiny_spec.vocab_size) and hidden == (1, K + 1, tiny_spec.hidden_size)
    sig = GraphSignature(graph.params, graph.outputs, graph.host_transfers)
    assert check_graph(graph.hlo, sig, expectation_for(tiny_spec, tp, 64, K + 1, torch.bfloat16)) == []
