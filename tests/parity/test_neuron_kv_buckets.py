"""The neuron backend's KV buckets, through the NxD contract double (tests/nxd_double).

The backend traces one ModelBuilder graph per (sequence length, KV bucket) of graphs.kv_graph_plan
and runs each call on the graph of its length at the smallest KV bucket holding its positions. The
double bakes each tag's module as it was traced, so a graph reads exactly the slots its trace read.
Then `check --backend neuron --sliding-cache ring` on the long-context fixture (window 8, prompts of
2-4 windows in chunks of 12 and 4) at TP=2 in bf16, by the CPU backend's policy.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.backends import neuron, neuron_env
from harness.base.settings import RunSettings
from harness.port import graphs
from tests.faults.catalog import LONG_BUCKETS, LONG_KV_LEN, LONG_NEW_TOKENS, LONG_PROMPTS
from tests.nxd_double import installed

BUCKETS, KV_LEN = (16,), 64  # KV buckets 16, 32, 64


@pytest.fixture(scope="module")
def nxd(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path_factory.mktemp("neuron-cache")))
        mp.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
        mp.setattr(neuron_env, "neuron_core_count", lambda: 16)  # where the core assignment counts them
        with installed(mp):
            yield


@pytest.fixture(scope="module")
def parity(nxd, tiny0_ckpt):
    settings = RunSettings(backend="neuron", tp=2, dtype=torch.bfloat16, buckets=BUCKETS, kv_len=KV_LEN)
    return neuron.NeuronBackend(tiny0_ckpt, settings, capture=True)


def _ran(backend, monkeypatch) -> list[str]:
    """The model_name of every graph the NxDModel runs from now on."""
    ran, real = [], backend.nxd_model.forward

    def forward(*args, model_name=None, **kwargs):
        ran.append(model_name)
        return real(*args, model_name=model_name, **kwargs)

    monkeypatch.setattr(backend.nxd_model, "forward", forward)
    return ran


def test_traced_tags_are_the_plan(parity):
    """Every (length, KV bucket) of graphs.kv_graph_plan is a traced graph, and nothing else; each
    graph's linear caches read its KV bucket (as baked into its trace)."""
    plan = graphs.kv_graph_plan(BUCKETS, KV_LEN)
    assert {kv for _, _, kv in plan} == {16, 32, 64}
    assert set(parity.nxd_model.graphs) == {f"{tag}_kv{kv}" for tag, _, kv in plan}
    for tag, _, kv in plan:
        traced = parity.nxd_model.traced_modules[neuron.kv_tag(tag, kv)]
        assert {layer.self_attn.cache.read_len for layer in traced.layers} == {kv}
    meta = json.loads((parity.artifact_dir / neuron.META_FILE).read_text())
    assert meta["graphs"] == {f"{tag}_kv{kv}": [length, kv] for tag, length, kv in plan}


def test_the_kv_plan_is_in_the_cache_key():
    base = dict(spec_hash="s", buckets=(16,), tp=2, compiler_version="c", compiler_args="", model_source_hash="m",
                capture=False, max_len=64)
    small = neuron.kv_tags((16,), 64)
    other = {**small, "decode_kv64": (1, 32)}
    assert neuron.artifact_cache_key(**base, kv_graphs=small) != neuron.artifact_cache_key(**base, kv_graphs=other)
    assert neuron.artifact_cache_key(**base, kv_graphs=small) != neuron.artifact_cache_key(**base)


def test_a_short_decode_runs_the_small_bucket_graph(parity, monkeypatch):
    """Prefill 12 tokens, decode at position 12 and at 40: the graphs run are prefill_16 and decode
    at KV 16, then decode at KV 64. The small graph reads only its 16 slots: NaN written into every
    cache's slots 16.. leaves its logits finite, while the KV-64 graph on the same state reads them."""
    ran = _ran(parity, monkeypatch)
    hidden = parity.spec.hidden_size
    parity.reset()
    x = torch.randn(1, 16, hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    positions = torch.cat([torch.arange(12), torch.full((4,), -1)])[None]
    parity.forward(x, positions, last=11)
    for rank in range(parity.tp):
        for key in parity.kv_names:
            poisoned = parity.nxd_model.read_from_neuron_buffer(key, rank)
            poisoned[:, :, 16:] = float("nan")
            parity.nxd_model.write_to_neuron_buffer(poisoned, key, rank)
    step = torch.randn(1, 1, hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    short, _ = parity.forward(step, torch.tensor([[12]]))
    assert ran == ["prefill_16_kv16", "decode_kv16"] and parity.last_tag == "decode_kv16"
    assert torch.isfinite(short).all()
    long, _ = parity.forward(step, torch.tensor([[40]]))
    assert ran[-1] == "decode_kv64" and not torch.isfinite(long).all()  # the control: 64 slots read the NaN


@pytest.mark.slow  # the ring's graphs and tags through the double stay in the default lane (above)
def test_check_backend_neuron_ring_passes_on_the_long_fixture(nxd, long_dir, tmp_path, capsys):
    """`check --backend neuron --sliding-cache ring` at TP=2 in bf16 on the window-8 fixture (~10 s
    here): every chunk and decode step through the ring and the KV-bucket graphs, both stages by the
    CPU backend's policy, no real token divergence. (The fixture's greedy tokens differ from the
    reference's by near ties in bf16 on the cpu backend too: 5 flips, so SEQ_MATCH is False there.)"""
    from harness.cli import main

    out = tmp_path / "check.json"
    rc = main(["check", "--checkpoint", str(long_dir), "--prompts", str(LONG_PROMPTS), "--backend", "neuron",
               "--sliding-cache", "ring", "--tp", "2", "--dtype", "bf16",
               "--buckets", ",".join(map(str, LONG_BUCKETS)), "--kv-len", str(LONG_KV_LEN),
               "--new-tokens", str(LONG_NEW_TOKENS), "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-2000:]
    payload = json.loads(out.read_text())
    assert payload["passed"] is True and payload["failed_stage"] is None and payload["real_divergences"] == 0
    assert all(layer["pass"] for layer in payload["layers"])
