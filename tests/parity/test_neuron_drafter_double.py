"""The drafter on the neuron backend, through the NxD contract double (docs/speculative.md,
docs/neuron.md): the assistant's draft graphs are graphs of the target's own NxDModel
(harness/port/draft_graphs.py, harness/backends/neuron_drafter.py), reading the target's KV cache as
device state.

Default lane: the refusals and cache keys (the fused module itself, eagerly:
tests/unit/test_draft_graphs.py). Slow lane (the fitted pairs take minutes to build on first use,
a fused build through the double a few CPU-seconds): one small fused build (TP 1, fp32, one KV
bucket) where every graph carries the KV cache as state, a draft step on the device equals the CPU
drafter's on the same cache and speculative decode gives the CPU backend's tokens and acceptance;
`check --assistant A --speculate 3 --backend neuron` on both fitted pairs at TP 1 and 2, a
drafter fault failing the speculative stage, and the fold: a draft graph that reads the cache
without carrying it is refused at build time, and past that guard reads the trace-time zeros."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from harness.backends import build_drafter, build_engine, neuron, neuron_cache, neuron_env
from harness.base.errors import HarnessInputError, OptionError
from harness.base.settings import RunSettings
from harness.port import draft_graphs
from harness.port.graphs import GraphBuildError
from harness.port.decode import generate, speculative
from tests.nxd_double import installed

K = 3
PROMPT = [167, 112, 284, 335, 342]


@pytest.fixture
def nxd(tmp_path):
    """The double on sys.path and a fresh artifact cache (a fault must never meet a healthy entry)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "neuron-cache"))
        mp.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
        mp.setattr(neuron_env, "neuron_core_count", lambda: 16)
        with installed(mp):
            yield mp


def pair(name: str = "12b"):
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY
    from harness.reference.tiny_assistant import tiny_assistant

    target, assistant = tiny_assistant(0, TINY_CONFIG if name == "12b" else TINY_FAMILY["31b"])
    ckpt = Checkpoint.open(target)
    return ckpt, AssistantCheckpoint.open(assistant, ckpt.spec)


def small(backend: str, assistant, tp: int = 1) -> RunSettings:
    return RunSettings(backend=backend, tp=tp, dtype="float32", buckets=(16,), kv_len=16, speculate=K,
                       assistant=None if assistant is None else str(assistant.path))


def draft_states(engine, tag: str) -> set[str]:
    from torch_neuronx.proto import metaneff_pb2

    state = metaneff_pb2.MetaTensor.Type.INPUT_STATE
    return {t.checkpoint_key.decode() for t in engine.backend.nxd_model.get_metaneff(tag).input_tensors if t.type == state}


@pytest.mark.slow  # a fused build through the double (~4 CPU-s) and the fitted pair (minutes to build on first use)
def test_the_draft_graphs_read_the_targets_cache_on_the_device(nxd):
    ckpt, assistant = pair()
    dev = build_engine(ckpt, small("neuron", assistant), capture=True)
    cpu = build_engine(ckpt, small("cpu", assistant), capture=True)
    be = dev.backend
    assert set(be.draft_graphs) == {"draft_kv16"} and {"draft_kv16", "verify_4_kv16"} <= set(be.nxd_model.graphs)
    assert draft_states(dev, "draft_kv16") == set(be.kv_names)  # the cache is the draft graph's state
    on_dev, on_cpu = build_drafter(dev, assistant), build_drafter(cpu, assistant)
    pre_dev, pre_cpu = dev.prefill(PROMPT, capture=True), cpu.prefill(PROMPT, capture=True)
    hidden = pre_cpu.captures["final_norm"][-1:][None]
    embeds = cpu.embed(torch.tensor([int(pre_cpu.logits[-1].argmax())]))
    got, state, caps = on_dev.step(embeds, hidden, len(PROMPT), capture=True)
    want, want_state, want_caps = on_cpu.step(embeds, hidden, len(PROMPT), capture=True)
    assert on_dev.last_tag == "draft_kv16" and list(caps) == list(want_caps)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.float(), want_state.float(), atol=1e-4, rtol=1e-4)
    assert torch.equal(caps["drafter.clusters"], want_caps["drafter.clusters"])
    # on a cache of zeros the same step is another one: what a draft graph folding the cache would read
    for rank in range(be.tp):
        for key in be.kv_names:
            be.nxd_model.write_to_neuron_buffer(torch.zeros(be.state_specs[key][0]), key, rank)
    assert (on_dev.step(embeds, hidden, len(PROMPT))[0] - got).abs().max() > 1e-2
    run_dev = generate(dev, [PROMPT], 8, speculative(on_dev, K))[0]
    run_cpu = generate(cpu, [PROMPT], 8, speculative(on_cpu, K))[0]
    assert run_dev.tokens == run_cpu.tokens and run_dev.accepted == run_cpu.accepted


def test_build_drafter_refuses_a_neuron_build_without_draft_graphs():
    target_only = SimpleNamespace(backend=SimpleNamespace(name="neuron", drafter=None))
    with pytest.raises(OptionError, match="no draft graphs"):
        build_drafter(target_only, SimpleNamespace(path="A"))
    other = SimpleNamespace(backend=SimpleNamespace(name="neuron", drafter=object(), assistant=SimpleNamespace(path="/a")))
    with pytest.raises(OptionError, match="another assistant"):
        build_drafter(other, SimpleNamespace(path="/b"))


def test_the_cache_key_tells_fused_builds_from_target_only_ones():
    from harness.backends.neuron_drafter import draft_tags, drafter_key
    from tests.unit.test_draft_graphs import fused

    assistant = SimpleNamespace(spec=fused("12b")[2])
    base = dict(spec_hash="s", buckets=(16,), tp=2, compiler_version="c", compiler_args=None, model_source_hash="m",
                capture=False)
    tags = draft_tags((16, 64))
    keys = {neuron_cache.artifact_cache_key(**base),
            neuron_cache.artifact_cache_key(**base, drafter=drafter_key(assistant.spec, 3, tags)),
            neuron_cache.artifact_cache_key(**base, drafter=drafter_key(assistant.spec, 4, tags)),
            neuron_cache.artifact_cache_key(**base, drafter=drafter_key(replace(assistant.spec, top_k_centroids=2), 3, tags))}
    assert len(keys) == 4  # target only; k 3; k 4; another assistant spec
    assert all(p in neuron_cache.ARTIFACT_KEY_FILES for p in neuron_cache.DRAFTER_SOURCE_FILES)


@pytest.mark.slow  # a batched fused build through the double (~10 graphs) and the cpu's batched run
def test_speculation_in_a_batch_on_the_device_is_the_cpus(nxd):
    """A build of 2 KV slots with the assistant: every draft graph takes the drafting slot
    (draft_seq) and carries the cache, the verify graph is traced at every batch bucket, and the one
    decode loop speculates three ragged prompts (the third takes the slot the first leaves) with each
    sequence drafting from its own slot: tokens, drafts and accepted drafts per verify equal the CPU
    backend's batched run, sequence for sequence, and the tokens are the target's own greedy ones."""
    ckpt, assistant = pair()
    settings = small("neuron", assistant).but(batch=2, buckets=(16, 32), kv_len=32)
    dev = build_engine(ckpt, settings, capture=True)
    cpu = build_engine(ckpt, settings.but(backend="cpu"), capture=True)
    be = dev.backend
    assert set(be.draft_graphs) == {"draft_kv16", "draft_kv32"}
    assert {f"verify_4_kv{kv}_bs{b}" for kv in (16, 32) for b in (1, 2)} <= set(be.nxd_model.graphs)
    routes = {a.route_key() for t, a in be.nxd_model.graphs.items() if t.startswith("draft")}
    assert len(routes) == 1 and "draft_seq: [1]" in routes.pop()  # one route: the slot is an input
    assert all(draft_states(dev, t) == set(be.kv_names) for t in be.draft_graphs)
    prompts = [PROMPT, list(range(3, 21)), [11, 7]]
    on_dev, on_cpu = build_drafter(dev, assistant), build_drafter(cpu, assistant)
    runs_dev = generate(dev, prompts, 6, speculative(on_dev, K))
    runs_cpu = generate(cpu, prompts, 6, speculative(on_cpu, K))
    assert on_dev.last_tag in be.draft_graphs and be.last_tag.startswith("verify_4_kv")
    alone = build_engine(ckpt, settings.but(backend="cpu", batch=1))
    for prompt, d, c in zip(prompts, runs_dev, runs_cpu, strict=True):
        assert (d.tokens, d.drafted, d.accepted) == (c.tokens, c.drafted, c.accepted) and d.drafted
        assert d.tokens == generate(alone, [prompt], 6)[0].tokens
    # a step from each slot (now the third and second sequences') is the cpu drafter's from that slot
    torch.manual_seed(0)
    embeds, hidden = torch.randn(1, 1, ckpt.spec.hidden_size), torch.randn(1, 1, ckpt.spec.hidden_size)
    steps = [on_dev.step(embeds, hidden, 8, slot=s)[0] for s in (0, 1)]
    for s, got in enumerate(steps):
        torch.testing.assert_close(got, on_cpu.step(embeds, hidden, 8, slot=s)[0], atol=1e-4, rtol=1e-4)
    assert (steps[0] - steps[1]).abs().max() > 1e-2  # the slots hold different sequences
    with pytest.raises(HarnessInputError, match="KV slot 2: the build has slots 0..1"):
        on_dev.step(embeds, hidden, 8, slot=2)


# ---- slow lane --------------------------------------------------------------------------------------

# A whole check through the double (~130 CPU-s at TP 2): references, three fused builds. The slow lane
# runs the 12B-like pair at TP 2 and the family pair at TP 1; the other two are `-m matrix` (by hand).
@pytest.mark.parametrize("name, tp", [pytest.param("12b", 2, marks=pytest.mark.slow),
                                      pytest.param("31b", 1, marks=pytest.mark.slow),
                                      pytest.param("12b", 1, marks=pytest.mark.matrix),
                                      pytest.param("31b", 2, marks=pytest.mark.matrix)])
def test_check_with_the_assistant_passes_through_the_double(nxd, name, tp, tmp_path, capsys):
    from harness.cli import main

    ckpt, assistant = pair(name)
    out = tmp_path / "check.json"
    rc = main(["check", "--checkpoint", str(ckpt.path), "--assistant", str(assistant.path), "--speculate", str(K),
               "--backend", "neuron", "--buckets", "16,256", "--kv-len", "256", "--tp", str(tp), "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    stage = result["extra_stages"]["speculative"]
    assert rc == 0 and result["passed"] and stage["ran"] and stage["passed"], (stage["failures"], printed[-1500:])
    assert stage["acceptance"] and all(a["passed"] for a in stage["acceptance"])
    assert max(a["port"] for a in stage["acceptance"]) >= 0.5  # drafts accepted: the drafter read the live cache


def speculative_stage(name: str = "12b", tp: int = 2):
    from harness.parity.speculative import check_speculative
    from tests.faults.test_speculate_faults import pair as fitted

    ckpt, assistant_dir, refs = fitted(name)
    settings = RunSettings(backend="neuron", tp=tp, dtype="bfloat16", buckets=(16, 64), kv_len=64)
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint

    return check_speculative(ckpt, refs["float32"], refs["bfloat16"], SimpleNamespace(band=4.0), settings=settings,
                             assistant=AssistantCheckpoint.open(assistant_dir, ckpt.spec), k=K)


@pytest.mark.slow
def test_a_drafter_reading_the_wrong_layers_cache_fails_the_stage(nxd):
    """Each draft layer reads the first target layer of its store layer's type instead (same shapes)."""
    original = draft_graphs.DraftingDecoder.target_kv

    def wrong(self, source):
        layers = self.spec.layers
        return original(self, next(t.index for t in layers if t.type == layers[source].type and t.index != source))
    nxd.setattr(draft_graphs.DraftingDecoder, "target_kv", wrong)
    stage = speculative_stage()
    points = {f["point"] for f in stage.failures()}
    assert not stage.passed and any(p.startswith(("bf16.drafter", "fp32.drafter")) for p in points), points


@pytest.mark.slow
def test_a_draft_graph_not_carrying_the_cache_is_refused_and_would_read_zeros(nxd):
    """The fold (tests/nxd_double model_builder_v2: a buffer a graph never reassigns is a constant of
    its trace): without carry_kv the build is refused naming the draft graph; past that guard the
    drafter reads the trace-time zeros, not the cache the target wrote, and the stage fails."""
    nxd.setattr(draft_graphs.DraftingDecoder, "carry_kv", lambda self, slot: None)
    ckpt, assistant = pair()
    with pytest.raises(GraphBuildError, match="graph draft_kv16 does not carry KV cache"):
        build_engine(ckpt, small("neuron", assistant))
    from harness.backends import neuron_build

    original = neuron.graph_io
    for module in (neuron, neuron_build):  # the build's check and the backend's own read, past the guard
        nxd.setattr(module, "graph_io", lambda model, tags, *a, **kw: original(
            model, {t: v for t, v in tags.items() if not t.startswith("draft")}, *a, **kw))
    dev = build_engine(ckpt, small("neuron", assistant), capture=True)
    assert draft_states(dev, "draft_kv16") == set()  # the double folded the cache into the draft graph
    cpu = build_engine(ckpt, small("cpu", assistant), capture=True)
    pre = cpu.prefill(PROMPT, capture=True)
    dev.prefill(PROMPT)
    hidden, embeds = pre.captures["final_norm"][-1:][None], cpu.embed(torch.tensor([5]))
    live = build_drafter(cpu, assistant).step(embeds, hidden, len(PROMPT))[0]
    folded = build_drafter(dev, assistant).step(embeds, hidden, len(PROMPT))[0]
    cpu.backend.reset()  # the CPU drafter on a cache of zeros reads what the folded graph reads
    zeros = build_drafter(cpu, assistant).step(embeds, hidden, len(PROMPT))[0]
    torch.testing.assert_close(folded, zeros, atol=1e-4, rtol=1e-4)
    assert (folded - live).abs().max() > 1e-2
    stage = speculative_stage()
    points = {f["point"] for f in stage.failures()}
    assert not stage.passed and any(p.startswith(("bf16.drafter", "fp32.drafter")) for p in points), points
    # the acceptance gate reads the fp32 run, which runs on the host like the fp32 stage (issue 46: an fp32
    # device build is over a NeuronCore for the 12B): the device's fault shows at the drafter points above
    assert stage.error is None and stage.acceptance and all(a["passed"] for a in stage.acceptance)


@pytest.mark.slow  # a perf build through the double and the mirror pair's bench
def test_bench_with_the_assistant_runs_the_perf_builds_draft_graphs(nxd, tmp_path):
    """`bench --backend neuron --assistant A --speculate 3` on the mirror pair (drafts mostly accepted):
    the perf build's draft graphs (no captures) and the verify graph's prompt state drive speculative
    decode to the plain decode's tokens, with the CPU backend's acceptance."""
    results = _bench_mirror_pair_on_neuron_and_cpu(tmp_path, ["--new-tokens", "12", "--kv-len", "64"])
    dev, cpu = (r["speculative"] for r in results)
    assert dev["tokens_equal"] and dev["accepted_per_verify"] > 1.0
    assert dev["accepted_per_verify"] == cpu["accepted_per_verify"] and dev["draft_step_ms"] > 0


# A batched check through the double (~65 CPU-s at TP 2, --batch 4: 27 graphs, both references). The
# slow lane runs TP 2; TP 1 is `-m matrix` (by hand). Cheap sibling: test_speculation_in_a_batch_is_refused_
# only_where_the_drafter_reads_one_sequence (tests/unit/test_speculate.py) and tests/unit/test_draft_graphs.py.
@pytest.mark.parametrize("name, tp", [pytest.param("12b", 2, marks=pytest.mark.slow),
                                      pytest.param("12b", 1, marks=pytest.mark.matrix),
                                      pytest.param("31b", 2, marks=pytest.mark.matrix)])
def test_check_batch_4_with_the_assistant_passes_through_the_double(nxd, name, tp, tmp_path, capsys):
    """`check --batch 4 --assistant A --speculate 3 --backend neuron` on the 12B-like tiny pair (and,
    by hand, the family's 31B-like pair) with five ragged prompts (1 to 20 tokens, one past the bucket; the fifth takes a slot a finished one
    leaves): every stage passes, the speculative stage ran as a batch of 4 (each sequence drafting
    from its own slot), its greedy tokens are the target's own and its acceptance is judged per
    sequence, equal to the like-for-like reference's."""
    from harness.cli import main

    ckpt, assistant = pair(name)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([PROMPT, [11], list(range(40, 60)), PROMPT[::-1] + [9, 9, 31, 4], list(range(3, 17))]))
    out = tmp_path / "check.json"
    rc = main(["check", "--checkpoint", str(ckpt.path), "--assistant", str(assistant.path), "--speculate", str(K),
               "--backend", "neuron", "--buckets", "16", "--kv-len", "64", "--tp", str(tp), "--batch", "4",
               "--prompts", str(prompts), "--skip-served-build", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    stage = result["extra_stages"]["speculative"]
    assert rc == 0 and result["passed"] and stage["ran"] and stage["passed"], (stage["failures"], printed[-1500:])
    assert any("batch of 4" in n and "its own slot" in n for n in stage["notes"]), stage["notes"]
    from harness.backends.neuron import kv_tags
    from harness.backends.neuron_drafter import draft_tags
    from harness.port.graphs import kv_buckets

    graphs = len(kv_tags((16,), 64, slots=4, speculate=K)) + len(draft_tags(kv_buckets((16,), 64)))
    assert f"{graphs} graphs (parity build {graphs})" in printed  # the plan gate counted what was built
    assert [a["prompt"] for a in stage["acceptance"]] == list(range(5))
    assert all(a["passed"] and a["reference_tokens_equal"] and a["accepted"] == a["reference_accepted"]
               for a in stage["acceptance"]), stage["acceptance"]
    # greedy tokens identical to the target's own: the bf16 stage's batched greedy decode on the same build kind
    assert [p["tokens"] for p in stage["prompts"]] == [p["device_tokens"] for p in result["prompts"]]


@pytest.mark.slow  # a batched perf build with the drafter through the double, and the cpu's (~40 CPU-s)
def test_bench_batch_with_the_assistant_reports_acceptance_per_batch_through_the_double(nxd, tmp_path):
    """`bench --batch 1,4 --assistant A --speculate 3 --backend neuron` on the mirror pair (drafts
    mostly accepted): each batch decoded speculatively on the batched perf build (its draft graphs
    taking the slot, its verify graph at every batch bucket), every sequence's tokens its plain
    greedy decode's, and the accepted drafts per verify of each batch, per sequence, the cpu
    backend's."""
    results = _bench_mirror_pair_on_neuron_and_cpu(tmp_path, ["--batch", "1,4", "--new-tokens", "8", "--kv-len", "32"])
    dev, cpu = ({r["batch"]: r["speculative"] for r in res["batch"]["rows"]} for res in results)
    assert sorted(dev) == [1, 4]
    for b, s in dev.items():
        assert s["tokens_equal"] and s["k"] == K and len(s["per_sequence"]) == b and s["verifies"] > 0, s
        assert s["per_sequence"] == cpu[b]["per_sequence"] and s["accepted_per_verify"] == cpu[b]["accepted_per_verify"]
    assert dev[4]["per_sequence"][0] == dev[1]["per_sequence"][0] and dev[4]["accepted_per_verify"] > 1.0


def _bench_mirror_pair_on_neuron_and_cpu(tmp_path, options: list) -> tuple:
    """`bench --assistant A --speculate K` on the mirror pair (drafts mostly accepted) at TP 2, through
    the double and on the cpu backend with the same `options`: the two results files, read."""
    from harness.cli import main
    from harness.reference.mirror_assistant import mirror_pair

    target, assistant = mirror_pair(0)
    results = []
    for backend in ("neuron", "cpu"):
        out = tmp_path / f"{backend}.json"
        assert main(["bench", "--checkpoint", str(target), "--assistant", str(assistant), "--speculate", str(K),
                     "--backend", backend, "--tp", "2", "--runs", "1", "--warmup", "0", "--buckets", "16",
                     *options, "--out", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    return tuple(results)
