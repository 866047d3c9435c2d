"""Speculative decoding on the fitted tiny target + assistant pairs (harness/reference/tiny_assistant.py):
the healthy port passes the speculative stage (tokens, drafter points, acceptance within the band
of transformers' assisted generation) on the unified 12B-like pair and the gemma4 family pair at
TP 1 and 2; each drafter/verify fault fails it, and says where. The acceptance-only fault (an engine
accepting at most one draft) leaves the tokens and the drafter's points right: it fails `check` on
the mirror pair (harness/reference/mirror_assistant.py), whose drafts are mostly accepted.

Slow lane: the fitted pairs take minutes to build on first use (then cached)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from harness.backends import cpu_drafter
from harness.base.settings import RunSettings
from harness.port import drafter as port_drafter
from harness.port import engine as port_engine
from harness.port import speculate as port_speculate
from types import SimpleNamespace

pytestmark = pytest.mark.slow

PROMPTS = [[167, 112, 284, 335, 342, 278, 194], [363, 311, 417, 83, 309, 76, 504, 405, 494],
           [2, 17, 93, 5, 44, 301, 7, 8]]
NEW_TOKENS, K = 12, 3


@functools.lru_cache(maxsize=None)
def pair(name: str):
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY
    from harness.reference.run import run_reference
    from harness.reference.tiny_assistant import tiny_assistant

    target, assistant = tiny_assistant(0, TINY_CONFIG if name == "12b" else TINY_FAMILY["31b"])
    refs = run_reference(target, PROMPTS, NEW_TOKENS)
    return Checkpoint.open(target), assistant, refs


def run_stage(name: str, tp: int = 2):
    from harness.parity.speculative import check_speculative

    ckpt, assistant, refs = pair(name)
    settings = RunSettings(tp=tp, dtype="bfloat16", buckets=(16, 64), kv_len=64)
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint

    return check_speculative(ckpt, refs["float32"], refs["bfloat16"], SimpleNamespace(band=4.0), settings=settings,
                             assistant=AssistantCheckpoint.open(assistant, ckpt.spec), k=K)


@pytest.mark.parametrize("name", ["12b", "31b"])
@pytest.mark.parametrize("tp", [1, 2])
def test_healthy_pairs_pass_the_speculative_stage(name, tp):
    stage = run_stage(name, tp)
    assert stage.passed, stage.describe()
    assert all(p.departure is None or p.accounted for p in stage.prompts)
    assert max(a["reference"] for a in stage.acceptance) >= 0.5  # the fitted pair's drafts do get accepted
    assert len(stage.drafter_points) == 2 * 9  # bf16 and fp32, nine points each (state_fed included)


@dataclass(frozen=True)
class SpecFault:
    name: str
    inject: Callable  # (monkeypatch) -> None
    caught_by: str  # "tokens" | "drafter" | "acceptance" | "error"


def _wrong_layer(mp):
    """Each drafter layer reads the first target layer of its store layer's type (same shapes)
    instead of the store layer itself."""
    def other(target, source):
        return next(t.index for t in target.layers if t.type == target.layers[source].type and t.index != source)
    mp.setattr(cpu_drafter.CpuDrafter, "kv_for", lambda self, rank, slot=0: [
        tuple(t[slot:slot + 1] for t in self.backend.kv_cache(other(self.backend.spec, layer.kv_source), rank))
        for layer in self.spec.layers])


def _other_type(mp):
    mp.setattr(cpu_drafter.CpuDrafter, "kv_for", lambda self, rank, slot=0: [
        tuple(t[slot:slot + 1] for t in self.backend.kv_cache(self.spec.layers[-1 - i].kv_source, rank))
        for i in range(len(self.spec.layers))])


def _swapped_inputs(mp):
    mp.setattr(port_drafter, "join_inputs", lambda embeds, hidden: torch.cat([hidden, embeds], dim=-1))


def _no_token_ordering(mp):
    original = port_drafter.rank_drafter_state

    def state(*args, **kwargs):
        out = original(*args, **kwargs)
        if "masked_embedding.token_ordering" in out:
            out["masked_embedding.token_ordering"] = torch.arange(out["masked_embedding.token_ordering"].numel())
        return out
    mp.setattr(cpu_drafter, "rank_drafter_state", state)


def _verify_one_off(mp):
    original = port_engine.Engine.verify_rows
    mp.setattr(port_engine.Engine, "verify_rows", lambda self, rows, positions, seq_ids, capture=False:
               original(self, rows, [p + 1 for p in positions], seq_ids, capture))


def _rejected_visible(mp):
    """No rollback: the next round starts after every drafted position, rejected ones included."""
    mp.setattr(port_speculate, "next_position", lambda position, accepted, drafted: position + drafted + 1)


def _state_not_fed_back(mp):
    mp.setattr(port_speculate, "next_state", lambda fed, produced: fed)


def _accept_at_most_one(mp):
    original = port_speculate.accepted_prefix
    mp.setattr(port_speculate, "accepted_prefix", lambda drafts, greedy: min(1, original(drafts, greedy)))


FAULTS = [
    SpecFault("drafter reads the wrong layer's KV", _wrong_layer, "drafter"),
    SpecFault("drafter reads the other attention type's KV", _other_type, "error"),
    SpecFault("hidden state and embedding concatenated in the wrong order", _swapped_inputs, "drafter"),
    SpecFault("token ordering not applied", _no_token_ordering, "drafter"),
    SpecFault("verify graph one position off", _verify_one_off, "tokens"),
    SpecFault("rejected KV entries left visible", _rejected_visible, "tokens"),
    SpecFault("post-projection state not fed back", _state_not_fed_back, "drafter"),
]
ACCEPTANCE_ONLY = SpecFault("the engine accepts at most one draft token", _accept_at_most_one, "acceptance")


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_speculative_fault_fails_the_stage(fault, monkeypatch):
    fault.inject(monkeypatch)
    stage = run_stage("12b")
    assert not stage.passed, fault.name
    failures = stage.failures()
    points = {f["point"] for f in failures}
    if fault.caught_by == "error":
        assert stage.error is not None
    elif fault.caught_by == "tokens":
        assert "speculative token" in points or stage.error is not None, failures
    elif fault.caught_by == "drafter":
        assert any(p.startswith(("bf16.drafter", "fp32.drafter", "drafter.clusters")) for p in points), failures
    else:  # acceptance alone: the tokens and the drafter's points are right
        assert points == {"acceptance"}, failures


def mirror_check(tmp_path, tp: int = 2) -> tuple[int, dict]:
    """`check --assistant A --speculate 3` on the mirror pair (harness/reference/mirror_assistant.py),
    in process (so a fault injected with monkeypatch applies): (exit code, its JSON)."""
    from harness.cli import main as cli
    from harness.reference.mirror_assistant import mirror_pair

    target, assistant = mirror_pair(0)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "check.json"
    code = cli(["check", "--checkpoint", str(target), "--assistant", str(assistant), "--speculate", str(K),
                "--prompts", str(prompts), "--new-tokens", str(NEW_TOKENS), "--tp", str(tp), "--skip-served-build",
                "--skip-fp32-stage", "--json", str(out)])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("name", ["12b", "31b"])
@pytest.mark.parametrize("tp", [1, 2])
def test_check_with_the_assistant_passes_on_both_pairs(name, tp, tmp_path):
    """The Done-when matrix on cpu: `check --checkpoint T --assistant A --speculate 3 --tp N` on the
    unified 12B-like pair and the gemma4 family pair, the default prompts, exit 0 with the
    speculative stage judged (its acceptance written per prompt)."""
    from harness.cli import main as cli
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY
    from harness.reference.tiny_assistant import tiny_assistant

    target, assistant = tiny_assistant(0, TINY_CONFIG if name == "12b" else TINY_FAMILY["31b"])
    out = tmp_path / "check.json"
    code = cli(["check", "--checkpoint", str(target), "--assistant", str(assistant), "--speculate", str(K),
                "--tp", str(tp), "--json", str(out)])
    result = json.loads(out.read_text())
    stage = result["extra_stages"]["speculative"]
    assert code == 0 and result["passed"] and stage["ran"] and stage["passed"], stage["failures"]
    assert stage["acceptance"] and all(a["passed"] for a in stage["acceptance"])


def test_the_mirror_pair_accepts_well_over_one_draft_and_passes(tmp_path):
    code, result = mirror_check(tmp_path)
    stage = result["extra_stages"]["speculative"]
    assert code == 0 and stage["passed"], stage["failures"]
    assert max(a["reference"] for a in stage["acceptance"]) >= 2.0  # something for a capped engine to lose
    assert [a["accepted"] for a in stage["acceptance"]] == [a["reference_accepted"] for a in stage["acceptance"]]


def test_an_engine_accepting_at_most_one_draft_fails_check_by_acceptance_alone(tmp_path, monkeypatch):
    """Greedy verification keeps every token right (the served tokens pass), the drafter is
    untouched (its points pass): only acceptance sees the fault."""
    ACCEPTANCE_ONLY.inject(monkeypatch)
    code, result = mirror_check(tmp_path)
    stage = result["extra_stages"]["speculative"]
    assert code == 1 and not result["passed"]
    assert {f["point"] for f in stage["failures"]} == {"acceptance"}, stage["failures"]
    assert all(p["passed"] for p in stage["drafter_points"])
    assert max(a["port"] for a in stage["acceptance"]) <= 1.0


@pytest.fixture(scope="module")
def golden_12b(tmp_path_factory):
    from harness.cli import main as cli

    target = pair("12b")[0].path
    out = tmp_path_factory.mktemp("golden") / "g"
    prompts = out.parent / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    assert cli(["reference", "--checkpoint", str(target), "--prompts", str(prompts), "--new-tokens", str(NEW_TOKENS),
                "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("fault", [None, "swapped"])
def test_bisect_with_the_assistant_names_the_drafters_first_failing_point(fault, golden_12b, tmp_path, monkeypatch):
    """`bisect --assistant A --speculate 3`: healthy, no drafter point named (exit 0); with the
    embedding and hidden state joined the wrong way, the drafter's first point, pre_projection."""
    from harness.cli import main as cli

    ckpt, assistant, _ = pair("12b")
    if fault:
        _swapped_inputs(monkeypatch)
    out = tmp_path / "bisect.json"
    code = cli(["bisect", "--checkpoint", str(ckpt.path), "--golden", str(golden_12b), "--assistant", str(assistant),
                "--speculate", str(K), "--json", str(out)])
    first = json.loads(out.read_text())["speculative"]["first_drafter_point"]
    if fault is None:
        assert code == 0 and first is None
    else:
        assert code == 1 and first["point"] == "fp32.drafter.pre_projection", first
