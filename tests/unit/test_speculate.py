"""Speculative decoding's parts that need no fitted assistant (default lane): the assistant's
config validated against its target with the key named, the accept rule, the drafter against
transformers' assistant on a random (unfitted) assistant, and speculative greedy output equal to
plain greedy decode whatever the drafter proposes."""

from __future__ import annotations

import json

import pytest
import torch

from harness import FIXTURES_DIR
from harness.base.errors import CheckpointError, ConfigError, OptionError
from harness.base.settings import RunSettings
from harness.inputs.assistant_spec import assistant_spec_from_dict
from harness.inputs.spec import load_spec
from harness.port.speculate import accepted_prefix, check_speculate
from harness.port.decode import generate, speculative

UNIFIED = FIXTURES_DIR / "configs" / "tiny" / "gemma-4-tiny-assistant.json"
FAMILY = FIXTURES_DIR / "configs" / "tiny" / "gemma-4-tiny-31b-assistant.json"


def _config(path=UNIFIED):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def target_spec(tiny0_dir):
    return load_spec(tiny0_dir)


@pytest.mark.parametrize("key, value, named", [
    ("backbone_hidden_size", 48, "backbone_hidden_size=48"),
    ("text_config.vocab_size", 256, "text_config.vocab_size=256"),
    ("text_config.head_dim", 8, "text_config.head_dim=8"),
    ("num_centroids", 7, "num_centroids=7"),
    ("centroid_intermediate_top_k", 99, "centroid_intermediate_top_k=99"),
    ("model_type", "gemma4_assistant", "model_type='gemma4_assistant'"),
])
def test_assistant_that_does_not_fit_the_target_is_refused_naming_the_key(target_spec, key, value, named):
    config = _config()
    section, _, leaf = key.rpartition(".")
    (config[section] if section else config)[leaf] = value
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        assistant_spec_from_dict(config, target_spec, "a.json")


def test_assistant_layers_read_the_targets_store_layers(target_spec):
    aspec = assistant_spec_from_dict(_config(), target_spec)
    assert [layer.kv_source for layer in aspec.layers] == [target_spec.kv_store[layer.type] for layer in aspec.layers]
    assert {layer.kv_source for layer in aspec.layers} == {10, 11}  # the last sliding and the last full layer
    full = aspec.layers[-1]
    assert (full.kv_heads, full.head_dim) == (target_spec.layers[11].kv_heads, target_spec.layers[11].head_dim)


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 9, 7], [5, 6, 7, 8]) == 1
    assert accepted_prefix([9, 6, 7], [5, 6, 7, 8]) == 0
    assert accepted_prefix([], [4]) == 0


@pytest.mark.parametrize("k, cache", [(0, "linear"), (17, "linear"), (True, "linear"), (3, "ring")])
def test_bad_speculate_settings_are_refused(k, cache):
    with pytest.raises(OptionError):
        check_speculate(k, RunSettings(sliding_cache=cache))


@pytest.fixture(scope="module")
def random_pair(tiny0_dir, tmp_path_factory):
    """The tiny 12B and an unfitted assistant of it (random weights, a random token ordering)."""
    from harness.inputs.assistant_checkpoint import AssistantCheckpoint
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import _save_atomically, randomize_for_margins
    from harness.reference.tiny_assistant import assistant_class

    config = _config()
    config.pop("architectures")
    config_cls, model_cls = assistant_class(config)
    torch.manual_seed(1)
    model = model_cls(config_cls(**config))
    randomize_for_margins(model, 1)
    model.masked_embedding.token_ordering.copy_(torch.randperm(512, generator=torch.Generator().manual_seed(1)))
    out = tmp_path_factory.mktemp("assistant") / "a"
    _save_atomically(model, out, False)
    ckpt = Checkpoint.open(tiny0_dir)
    return ckpt, AssistantCheckpoint.open(out, ckpt.spec), out


def test_assistant_checkpoint_with_a_damaged_tensor_is_refused_naming_it(random_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    from harness.inputs.assistant_checkpoint import AssistantCheckpoint

    ckpt, _, path = random_pair
    weights = load_file(str(path / "model.safetensors"))
    weights["masked_embedding.token_ordering"] = torch.zeros(512, dtype=torch.long)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="masked_embedding.token_ordering"):
        AssistantCheckpoint.open(tmp_path, ckpt.spec)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP 2: the slow lane
def test_speculative_greedy_equals_plain_greedy_and_the_drafter_equals_transformers(random_pair, tp):
    """fp32: the same tokens as plain greedy decode, and every drafter capture point of every draft
    step within fp32 rounding of transformers' assistant fed the same target states."""
    from harness.backends import build_drafter, build_engine
    from harness.judge.compare import FP32
    from harness.parity.speculative import drafter_points
    from harness.reference.assistant import AssistantReference

    ckpt, assistant, path = random_pair
    engine = build_engine(ckpt, RunSettings(tp=tp, dtype="float32", buckets=(16, 64), kv_len=64), capture=True)
    drafter = build_drafter(engine, assistant)
    prompts = [[2, 17, 93, 5, 44, 301, 7], list(range(3, 27))]  # the second passes the window of 16
    runs = generate(engine, prompts, 10, speculative(drafter, 3), capture=True)
    for prompt, run in zip(prompts, runs):
        assert run.tokens == generate(engine, [prompt], 10)[0].tokens
        assert sum(run.accepted) + run.verifies + 1 == 10
    refs = {dt: AssistantReference(path, dt) for dt in (torch.float32, torch.bfloat16)}
    if tp == 1:  # the acceptance judge's reference: transformers' pair under the port's rules, draft for draft
        from harness.reference.assistant import exact_acceptance, load_target

        target = load_target(ckpt.path)
        for prompt, run in zip(prompts, runs):
            assert exact_acceptance(target, refs[torch.float32].model, prompt, 10, 3) == (run.tokens, run.accepted)
    points, clusters_off, _ = drafter_points(runs, engine, ckpt.spec, refs, FP32)
    assert {p.name for p in points} >= {"fp32.drafter.pre_projection", "fp32.drafter.layers.3.output",
                                        "fp32.drafter.post_projection", "fp32.drafter.logits",
                                        "fp32.drafter.state_fed"}
    assert all(p.passed for p in points), [(p.name, p.ratio) for p in points if not p.passed]
    assert clusters_off == 0


def test_mirror_assistant_config_fits_its_target_and_reads_the_store_layers(target_spec, tiny0_dir):
    """The mirror pair's assistant (harness/reference/mirror_assistant.py): one layer per target
    layer, each reading the target's store layer of its type; only the store layers keep their
    attention in the mirror target."""
    from harness.reference.mirror_assistant import mirror_config, store_layers

    config = mirror_config(json.loads((tiny0_dir / "config.json").read_text()))
    aspec = assistant_spec_from_dict(config, target_spec)
    assert len(aspec.layers) == len(target_spec.layers) and aspec.hidden_size == target_spec.hidden_size
    assert [layer.type for layer in aspec.layers] == [layer.type for layer in target_spec.layers]
    assert {layer.kv_source for layer in aspec.layers} == set(target_spec.kv_store.values())
    assert store_layers([layer.type for layer in target_spec.layers]) == {10, 11} and not aspec.ordered


def test_drafter_with_the_inputs_swapped_departs_from_transformers(random_pair, monkeypatch):
    """The same comparison fails when the hidden state and the embedding are joined the wrong way."""
    from harness.backends import build_drafter, build_engine
    from harness.judge.compare import FP32
    from harness.parity.speculative import drafter_points
    from harness.port import drafter as port_drafter
    from harness.reference.assistant import AssistantReference

    monkeypatch.setattr(port_drafter, "join_inputs", lambda embeds, hidden: torch.cat([hidden, embeds], dim=-1))
    ckpt, assistant, path = random_pair
    engine = build_engine(ckpt, RunSettings(tp=1, dtype="float32", buckets=(16,), kv_len=32), capture=True)
    run = generate(engine, [[2, 17, 93, 5]], 4, speculative(build_drafter(engine, assistant), 3), capture=True)[0]
    refs = {dt: AssistantReference(path, dt) for dt in (torch.float32, torch.bfloat16)}
    points, _, _ = drafter_points([run], engine, ckpt.spec, refs, FP32)
    assert not next(p for p in points if p.name == "fp32.drafter.pre_projection").passed


def test_cluster_choices_are_judged_with_their_own_band():
    """bf16 draft steps choosing other clusters are router decisions: a near tie when the swap's
    fp32 margin is within the band calibrated from the centroid scores' own bf16 shifts (not the
    token band), else a divergence; the band moves with the scores' noise."""
    from harness.judge.compare import ROUTING_FACTOR
    from harness.parity.speculative import cluster_decisions, same_clusters

    scores = torch.tensor([[5.0, 3.0, 2.7, 1.0, -4.0]] * 4)
    noisy = scores + torch.tensor([[0.0, 0.125, -0.125, 0.0, 0.0]])  # boundary margin 0.3 moved by 0.25
    ref = torch.tensor([[0.0, 1.0]])  # captures hold the cluster indices as floats
    assert same_clusters(torch.tensor([[1, 0]]), ref) and not same_clusters(torch.tensor([[0, 2]]), ref)
    steps = [(torch.tensor([[0.0, 1.0]]), scores[:1], noisy[:1])] * 3 + [(torch.tensor([[2.0, 0.0]]), scores[:1], noisy[:1])]
    tie = cluster_decisions(steps, 2)
    assert abs(tie.band - ROUTING_FACTOR * 0.25) < 1e-4 and tie.samples == 4  # the tail band: 0.375 > 0.3
    assert [(f.kind, f.where, f.port_experts, f.reference_experts) for f in tie.flips] == [
        ("near_tie", "bf16 draft step 3", [0, 2], [0, 1])]
    quiet = cluster_decisions([(c, s, s) for c, s, _ in steps], 2)  # no bf16 noise: band 0, the ULP floor (0.125) only
    assert quiet.band == 0.0 and [f.kind for f in quiet.flips] == ["divergence"]
    far = cluster_decisions(steps[:3] + [(torch.tensor([[0.0, 4.0]]), scores[:1], noisy[:1])], 2)
    assert [f.kind for f in far.flips] == ["divergence"] and abs(far.flips[0].margin - 7.0) < 1e-6


def test_drafter_not_fed_its_post_projection_fails_state_fed(random_pair, monkeypatch):
    """A later draft step of a round fed the round's first state instead of the step before's
    post-projection: every point of the step itself agrees (fed the port's own inputs), state_fed fails."""
    from harness.backends import build_drafter, build_engine
    from harness.judge.compare import FP32
    from harness.parity.speculative import drafter_points
    from harness.port import speculate as port_speculate
    from harness.reference.assistant import AssistantReference

    monkeypatch.setattr(port_speculate, "next_state", lambda fed, produced: fed)
    ckpt, assistant, path = random_pair
    engine = build_engine(ckpt, RunSettings(tp=1, dtype="float32", buckets=(16,), kv_len=32), capture=True)
    run = generate(engine, [[2, 17, 93, 5]], 4, speculative(build_drafter(engine, assistant), 3), capture=True)[0]
    refs = {dt: AssistantReference(path, dt) for dt in (torch.float32, torch.bfloat16)}
    points, _, _ = drafter_points([run], engine, ckpt.spec, refs, FP32)
    assert [p.name for p in points if not p.passed] == ["fp32.drafter.state_fed"]


def test_info_fits_target_and_assistant_together(tiny0_dir, tmp_path, capsys):
    """`info --assistant DIR`: the per-core fit it refuses by counts the drafter's weights and its draft
    graphs beside the target's (instances.core_bytes), and says so on its line."""
    from harness.cli import main
    from harness.inputs.spec import dtype_bytes

    (tmp_path / "config.json").write_text(UNIFIED.read_text())
    alone, pair = tmp_path / "alone.json", tmp_path / "pair.json"
    assert main(["info", "--checkpoint", str(tiny0_dir), "--tp", "2", "--json", str(alone)]) == 0
    assert main(["info", "--checkpoint", str(tiny0_dir), "--tp", "2", "--assistant", str(tmp_path),
                 "--json", str(pair)]) == 0
    a, p = (json.loads(f.read_text())["placement"]["core"] for f in (alone, pair))
    drafter = assistant_spec_from_dict(_config(), load_spec(tiny0_dir)).bytes_per_rank(2, dtype_bytes("bfloat16"))
    assert a["drafter"] == 0 and p["drafter"] == drafter > 0
    assert p["graphs"] > a["graphs"] and p["run"] > a["run"] + drafter
    assert "assistant (" in capsys.readouterr().out
    spec3 = tmp_path / "spec3.json"  # --speculate 3: the verify graph at each KV bucket holding 4 positions
    assert main(["info", "--checkpoint", str(tiny0_dir), "--tp", "2", "--assistant", str(tmp_path), "--speculate",
                 "3", "--json", str(spec3)]) == 0
    s = json.loads(spec3.read_text())["placement"]["core"]
    assert s["graphs"] > p["graphs"] and s["run"] > p["run"]
    assert main(["info", "--checkpoint", str(tiny0_dir), "--speculate", "0"]) == 2  # refused, with the range
    assert "--speculate 0" in capsys.readouterr().err


def test_speculation_in_a_batch_equals_each_sequence_alone(random_pair):
    """The one decode loop speculates in a batch (issue 37): two slots, three ragged prompts (the
    third takes the slot the first leaves), each sequence drafting from its own slot. Tokens and
    accepted drafts per verify equal each prompt's run alone, and the tokens the target's own greedy."""
    from harness.backends import build_drafter, build_engine

    ckpt, assistant, _ = random_pair
    settings = RunSettings(dtype="float32", buckets=(16, 64), kv_len=64, speculate=3)
    batched, alone = (build_engine(ckpt, settings.but(batch=b), capture=True) for b in (2, 1))
    prompts = [[2, 17, 93, 5, 44, 301, 7], list(range(3, 27)), [11]]
    runs = generate(batched, prompts, 6, speculative(build_drafter(batched, assistant), 3))
    drafter = build_drafter(alone, assistant)
    for prompt, run in zip(prompts, runs):
        own = generate(alone, [prompt], 6, speculative(drafter, 3))[0]
        # the drafts too: a drafter reading another sequence's slot drafts other tokens
        assert (run.tokens, run.accepted, run.drafted) == (own.tokens, own.accepted, own.drafted) and run.drafted
        torch.testing.assert_close(run.step_logits, own.step_logits, atol=1e-4, rtol=1e-4)
        assert run.tokens == generate(alone, [prompt], 6)[0].tokens


def test_speculation_in_a_batch_is_refused_only_where_the_drafter_reads_one_sequence(monkeypatch):
    """`--batch 2 --assistant A --speculate 3` composes on cpu, xla and neuron (their drafters read each
    sequence's own KV slot; neuron's batched draft graphs take the slot, draft_seq). The command's list
    is the drafters' own word (`serves_slots`, which the decode loop reads); a backend off that list is
    refused before the assistant is read, naming the fix."""
    from types import SimpleNamespace

    from harness.backends.cpu_drafter import CpuDrafter
    from harness.backends.neuron_drafter import NeuronDrafter
    from harness.backends.xla_drafter import XlaDrafter
    from harness.cli import check as check_cli

    drafters = {"cpu": CpuDrafter, "xla": XlaDrafter, "neuron": NeuronDrafter}
    assert set(check_cli.SLOT_DRAFTERS) == {b for b, cls in drafters.items() if getattr(cls, "serves_slots", False)}

    class Reached(Exception):
        pass

    def reached(args):
        raise Reached(args.settings.backend)
    monkeypatch.setattr(check_cli, "assistant_dir", reached)

    def args(backend):
        return SimpleNamespace(assistant="A", speculate=3, batch=2, settings=RunSettings(backend=backend, batch=2))
    for backend in ("cpu", "xla", "neuron"):
        given = args(backend)
        with pytest.raises(Reached):
            check_cli.validate_speculate(given, None)
        assert given.settings.speculate == 3
    monkeypatch.setattr(check_cli, "SLOT_DRAFTERS", ("cpu", "xla"))  # a drafter reading one sequence's cache
    with pytest.raises(OptionError, match="--batch 2 on the neuron backend.*drop --batch or use --backend cpu or xla"):
        check_cli.validate_speculate(args("neuron"), None)
