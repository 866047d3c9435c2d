"""Speculative decoding's verify graph (default lane, cpu): the draft length as a run setting, the
verify graph in the graph plan (a bucket of k+1 positions, picked by the verify flag, never by
length), a short round padded to k+1 rows equal bit for bit to the unpadded call, and what a perf
build's verify graph returns (every row's logits and the final-norm states). docs/speculative.md."""

from __future__ import annotations

import pytest
import torch

from harness.inputs.tiny import TINY_CONFIG
from harness.backends import build_engine, neuron
from harness.base.errors import HarnessInputError, OptionError, PromptError
from harness.base.settings import RunSettings
from harness.inputs.spec import load_spec
from harness.port import graphs
from harness.port.engine import Engine, chunk_positions
from harness.port.model import RankDecoder, RankLinears
from harness.port.speculate import check_verify_fit


@pytest.mark.parametrize("bad", [-1, True, 2.0, "3"])
def test_speculate_setting_must_be_a_non_negative_integer(bad):
    with pytest.raises(OptionError, match="--speculate"):
        RunSettings(speculate=bad)
    assert RunSettings().speculate == 0 and RunSettings(speculate=3).speculate == 3


def test_graph_plan_holds_the_verify_graph_only_with_speculate():
    assert graphs.graph_plan((16, 64), 128) == {"prefill_16": 16, "prefill_64": 64, "decode": 1}
    assert graphs.graph_plan((16, 64), 128, speculate=3) == {"prefill_16": 16, "prefill_64": 64, "decode": 1,
                                                             "verify_4": 4}
    with pytest.raises(HarnessInputError, match="--speculate 16: a verify of 17 positions exceeds the KV length 16"):
        graphs.graph_plan((16,), 16, speculate=16)
    plan = graphs.kv_graph_plan((16, 64), 128, speculate=3)
    assert {(length, kv) for tag, length, kv in plan if tag == "verify_4"} == {(4, kv) for kv in graphs.kv_buckets((16, 64), 128)}
    tags = neuron.kv_tags((16,), 64, speculate=3)  # the neuron build's tags (and so its cache key) follow
    assert set(tags) - set(neuron.kv_tags((16,), 64)) == {t for t in tags if t.startswith("verify_4_kv")} != set()


def test_verify_calls_run_the_verify_graph_and_prefill_calls_never_do():
    plan = graphs.graph_plan((4, 16), 32, speculate=3)  # a prefill bucket of k+1 positions too
    assert graphs.tag_for_length(4, plan) == "prefill_4"
    assert graphs.tag_for_length(4, plan, verify=True) == "verify_4"
    with pytest.raises(HarnessInputError, match="no verify graph takes 3 positions.*--speculate"):
        graphs.tag_for_length(3, plan, verify=True)
    with pytest.raises(HarnessInputError, match="no verify graph"):
        graphs.tag_for_length(4, graphs.graph_plan((4, 16), 32), verify=True)


def test_a_perf_builds_verify_graph_returns_every_row_and_the_final_norm():
    spec = load_spec(TINY_CONFIG)
    plan = graphs.graph_plan((16,), 32, speculate=3)
    embeds, positions = torch.zeros(1, 4, spec.hidden_size), chunk_positions(5, 2, 4)  # [[5, 6, -1, -1]]
    tag, inputs = graphs.graph_inputs(spec, plan, embeds, positions, torch.float32, capture=False, parity_build=False,
                                      last_row_only=True, last=None, verify=True)
    assert tag == "verify_4" and len(inputs) == 2  # no last_index: every row comes back
    with pytest.raises(HarnessInputError, match="pass last="):  # a prefill chunk of a perf build still needs it
        graphs.graph_inputs(spec, plan, torch.zeros(1, 16, spec.hidden_size), torch.arange(16)[None], torch.float32,
                            capture=False, parity_build=False, last_row_only=True, last=None)
    torch.manual_seed(0)
    perf = graphs.TracedDecoder(spec, 1, 32, torch.float32, RankLinears(), last_row_only=True)
    x = torch.randn(1, 4, spec.hidden_size)
    with torch.no_grad():
        logits, caps = graphs.graph_result(perf(x, positions), None, x, False, True, None, verify=True)
        want_logits, want_caps = RankDecoder.forward(perf, x, positions, capture=True)  # what a parity build returns
    assert logits.shape == want_logits.shape == (1, 4, spec.vocab_size) and list(caps) == ["final_norm"]
    assert torch.equal(logits, want_logits) and torch.equal(caps["final_norm"], want_caps["final_norm"])


class Recorder:
    """A backend that records what the engine asks of it."""

    name, returns_captures, last_row_only, reads_cache, host_ranks, tp = "recorder", False, True, False, False, 1

    def __init__(self, vocab, hidden):
        self.vocab, self.hidden, self.calls = vocab, hidden, []

    def forward(self, inputs_embeds, positions, capture=False, last=None, verify=False):
        self.calls.append((positions.tolist(), verify))
        s = positions.shape[1]
        return torch.zeros(1, s, self.vocab), {"final_norm": torch.zeros(1, s, self.hidden)}


def test_a_short_round_is_padded_to_the_one_verify_graph(tiny0_ckpt):
    spec = tiny0_ckpt.spec
    backend = Recorder(spec.vocab_size, spec.hidden_size)
    engine = Engine(spec, backend, tiny0_ckpt.embed_weight(torch.bfloat16), RunSettings(buckets=(16,), kv_len=32,
                                                                                       speculate=3))
    step = engine.verify([5, 6], 10)
    assert backend.calls == [([[10, 11, -1, -1]], True)]
    assert step.logits.shape == (2, spec.vocab_size) and step.captures["final_norm"].shape == (2, spec.hidden_size)
    with pytest.raises(PromptError, match="verifies k\\+1 = 4 at most"):
        engine.verify([1, 2, 3, 4, 5], 10)
    with pytest.raises(PromptError, match="4 rows at position 29 is past the KV length 32"):
        engine.verify([5], 29)  # the padded rows' slots must exist
    with pytest.raises(PromptError, match="leave 3 more slots"):
        check_verify_fit(20, 13, 3, 32)
    check_verify_fit(20, 10, 3, 32)


def test_padded_verify_equals_the_unpadded_one_bit_for_bit_on_cpu(tiny0_ckpt):
    prompt, drafts, out = [2, 17, 93, 5, 40, 8], [11, 12], {}
    for k in (0, 3):
        engine = build_engine(tiny0_ckpt, RunSettings(tp=1, buckets=(8,), kv_len=32, speculate=k), capture=True)
        engine.prefill(prompt)
        out[k] = engine.verify([7] + drafts, len(prompt)), engine.read_cache(len(prompt) + 3)
    (plain, plain_cache), (padded, padded_cache) = out[0], out[3]
    assert padded.logits.shape == (3, tiny0_ckpt.spec.vocab_size)
    assert torch.equal(plain.logits, padded.logits)
    assert plain.captures.keys() == padded.captures.keys() and "final_norm" in padded.captures
    assert all(torch.equal(plain.captures[n], padded.captures[n]) for n in plain.captures)
    assert all(torch.equal(a, b) for x, y in zip(plain_cache, padded_cache) for a, b in zip(x, y))


class NoDrafts:
    """A drafter stub: always drafts token 0 (what the Recorder's zero logits choose too)."""

    def step(self, embeds, hidden, position, capture=False):
        return torch.zeros(8), hidden, {}


def test_a_perf_build_seeds_the_first_draft_from_the_verify_graph(tiny0_ckpt):
    """A perf build's prefill returns no final-norm state: all but the last prompt token are
    prefilled, the last runs through the verify graph (decode._prefill_by_verify)."""
    from harness.port.decode import generate, speculative

    spec = tiny0_ckpt.spec
    backend = Recorder(spec.vocab_size, spec.hidden_size)
    backend.reset = lambda: None
    engine = Engine(spec, backend, tiny0_ckpt.embed_weight(torch.bfloat16), RunSettings(buckets=(16,), kv_len=32,
                                                                                       speculate=3))
    run = generate(engine, [[5, 6, 7]], 5, speculative(NoDrafts(), 3))[0]
    assert backend.calls[0] == ([list(range(2)) + [-1] * 14], False)  # the prompt but its last token
    assert backend.calls[1] == ([[2, -1, -1, -1]], True)  # its last token, through the verify graph
    assert backend.calls[2] == ([[3, 4, 5, 6]], True) and run.accepted[0] == 3 and run.tokens == [0] * 5
