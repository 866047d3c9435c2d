"""The Neuron backend end to end on CPU, through the NxD contract double (tests/nxd_double).

The device tests of tests/parity/test_neuron_device.py run here unchanged, against the same
tolerance policy, with `neuronx_distributed` / `torch_neuronx` / `libneuronxla` provided by the
double: the tiny model at TP=2 in bf16 is traced per bucket, compiled (flags validated), saved to
and reloaded from the artifact cache, given per-rank weights, and run with the KV cache as
aliased device state across calls, on two ranks with real collectives. Then `check` and `bench`
through the CLI with the backend `neuron`, and one failing build per rule the double enforces.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness.backends import neuron, neuron_build, neuron_cache, neuron_env
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.port import graphs
from harness.port import kv_cache as port_kv
from harness.port import model as port_model
from tests.nxd_double import installed
from tests.parity import test_neuron_device as device

# ---- the double, for this whole module ------------------------------------------------------------


@pytest.fixture(scope="module")
def nxd(tmp_path_factory):
    """The double on sys.path, a fresh artifact cache, and NeuronCores the core assignment can use."""
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("neuron-cache")
        mp.setenv("GEMMA_PARITY_NEURON_CACHE", str(cache))
        mp.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
        mp.setenv("GEMMA_PARITY_INSTANCE_TYPE", "inf2.8xlarge")  # the bench's rates, whatever this host is
        # an inf2.48xlarge's worth, where the core assignment counts them: any xdist worker fits
        mp.setattr(neuron_env, "neuron_core_count", lambda: 16)
        with installed(mp):
            yield cache


@pytest.fixture(scope="module")
def cpu32(tiny0_ckpt):
    return device.engine_for(tiny0_ckpt, "cpu", torch.float32)


@pytest.fixture(scope="module")
def cpu16(tiny0_ckpt):
    return device.engine_for(tiny0_ckpt, "cpu", torch.bfloat16)


@pytest.fixture(scope="module")
def perf(nxd, tiny0_ckpt):
    return device.engine_for(tiny0_ckpt, "neuron", torch.bfloat16)


@pytest.fixture(scope="module")
def parity(nxd, tiny0_ckpt):
    return device.engine_for(tiny0_ckpt, "neuron", torch.bfloat16, capture=True)


# ---- the device suite, through the double -----------------------------------------------------------

test_prefill_bucket_compiles_runs_and_matches_cpu = device.test_prefill_bucket_compiles_runs_and_matches_cpu
test_decode_with_device_kv_cache_equals_recompute = device.test_decode_with_device_kv_cache_equals_recompute
test_device_kv_cache_holds_what_the_cpu_ranks_hold = device.test_device_kv_cache_holds_what_the_cpu_ranks_hold
test_reset_zeroes_the_device_kv_cache = device.test_reset_zeroes_the_device_kv_cache
test_cache_hit_reloads_the_same_graphs = device.test_cache_hit_reloads_the_same_graphs
test_perf_build_agrees_with_parity_build = device.test_perf_build_agrees_with_parity_build
test_perf_build_refuses_capture = device.test_perf_build_refuses_capture


def test_the_builds_are_what_the_issue_asks_for(perf, parity, nxd):
    """Pinned flags reach the compiler; no layout transform by default (no priority model); perf
    graphs return one row of logits; parity graphs do not return their own input; states are
    exactly the KV cache."""
    be = perf.backend
    assert be.compiled and be.compiler_args[:1] == ["--enable-saturate-infinity"]
    assert " --target inf2" in " " + " ".join(be.compiler_args)
    model = be.nxd_model
    assert model.layout_transformer is None and be.priority_key is None  # neuron_layers.DEFAULT_LAYOUT_PRIORITY
    art = model.graphs["decode_kv16"]
    assert art.compiler_flags.split().count("--enable-internal-neff-wrapper") == 0  # no WLO model
    assert "-O2" in art.compiler_flags.split() and "-O1" in model.graphs["prefill_64_kv64"].compiler_flags.split()
    assert "--enable-saturate-infinity" in model.graphs["prefill_64_kv64"].compiler_flags
    assert [shape for shape, _ in model.graphs["prefill_64_kv128"].outputs] == [(1, 1, perf.spec.vocab_size)]
    assert set(be.state_specs) == set(be.kv_names)
    names = parity.backend.capture_names
    assert "embeddings" not in names and len(parity.backend.nxd_model.graphs["prefill_16_kv16"].outputs) == len(names) + 1
    meta = json.loads((be.artifact_dir / neuron.META_FILE).read_text())
    assert meta["versions"]["libneuronxla"].startswith("2.2.17544")
    assert "libneuronxla=2.2.17544" in neuron.toolchain_version(be.versions)


def test_embeddings_capture_is_the_input_the_device_was_fed(parity, cpu16):
    ids = device.prompt(12, seed=6)
    dev, ref = parity.prefill(ids, capture=True), cpu16.prefill(ids, capture=True)
    assert list(dev.captures) == list(ref.captures)  # same points, same order as the CPU backend
    assert torch.equal(dev.captures["embeddings"], ref.captures["embeddings"])


def test_a_row_past_the_cache_is_refused_before_the_device_call(perf, monkeypatch):
    """A chunk whose padded rows would be written past the KV cache (rows 120..135 of 128), or a
    real position past it behind padding, is refused on the host (kv_slots.check_positions): no
    graph runs, so nothing lands in the next head's rows of the device's cache. Padded rows inside
    the cache still run."""
    be, width = perf.backend, graphs.input_width(perf.backend.spec)
    runs = []
    model = be.nxd_model
    monkeypatch.setattr(be, "nxd_model", lambda *a, **k: runs.append(k["model_name"]) or model(*a, **k))
    embeds = torch.zeros(1, 16, width, dtype=torch.bfloat16)
    row = list(range(device.KV_LEN - 8, device.KV_LEN))
    for positions, says in (([row + [-1] * 8], f"up to {device.KV_LEN + 7}, past the KV cache length {device.KV_LEN}"),
                            ([[-1] * 15 + [device.KV_LEN + 1]], f"position {device.KV_LEN + 1} is past the KV cache")):
        with pytest.raises(HarnessInputError, match=says):
            be.forward(embeds, torch.tensor(positions), last=7)
    assert runs == []
    be.forward(embeds, torch.tensor([list(range(device.KV_LEN - 16, device.KV_LEN - 8)) + [-1] * 8]), last=7)
    assert runs == ["prefill_16_kv128"]
    monkeypatch.undo()
    be.reset()


# ---- the CLI with --backend neuron -----------------------------------------------------------------

@pytest.mark.slow  # a whole `check` (both references, both stages) through the double
def test_check_backend_neuron_passes_through_the_cli(nxd, tmp_path, capsys):
    from harness.cli import main

    out = tmp_path / "check.json"
    # the default prompts reach position 243 (a 240-token prompt + 4 tokens): buckets and cache hold it
    rc = main(["check", "--model", "tiny", "--backend", "neuron", "--buckets", "16,256", "--kv-len", "256",
               "--new-tokens", "4", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-2000:]
    payload = json.loads(out.read_text())
    assert payload["passed"] is True and payload["seq_match"] is True and "SEQ_MATCH True" in printed
    assert all(layer["pass"] for layer in payload["layers"])


def test_bench_backend_neuron_runs_through_the_cli(nxd, tmp_path):
    from harness.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", "tiny", "--backend", "neuron", "--runs", "2", "--warmup", "0",
               "--buckets", "16,64", "--new-tokens", "3", "--kv-len", "128", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "neuron" and result["compiler_args"] == list(neuron.DEFAULT_COMPILER_ARGS)
    assert len(result["metrics"]["prefill_ms"]) == 2 and len(result["metrics"]["decode_ms_per_token"]) == 2
    assert set(result["prefill_ms_by_bucket"]) == {"16", "64"}


# ---- each rule of the double, broken on purpose: the build or the run fails -------------------------

def _build(tiny0_ckpt, tmp_path, **kwargs):
    return neuron.NeuronBackend(tiny0_ckpt, RunSettings(backend="neuron", buckets=(16,), kv_len=32),
                                cache_dir=tmp_path, **kwargs)


def test_healthy_small_build(nxd, tiny0_ckpt, tmp_path):
    """The control for the cases below: the same small build succeeds."""
    be = _build(tiny0_ckpt, tmp_path)
    assert be.compiled and list((tmp_path / be.cache_key).iterdir())


def test_rule_forward_defaults_only_none(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    def forward(self, inputs_embeds, positions, last_index=0):
        return port_model.RankDecoder.forward(self, inputs_embeds, positions.long())

    monkeypatch.setattr(graphs.TracedDecoder, "forward", forward)
    with pytest.raises(neuron.NeuronBuildError, match="non-None default"):
        _build(tiny0_ckpt, tmp_path)
    assert not any(p.name.startswith("perf") for p in tmp_path.iterdir())  # nothing cached


def test_rule_no_in_place_state_update(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    def update(self, positions, k, v):
        self.k.index_copy_(2, positions[0], k)
        self.v.index_copy_(2, positions[0], v)
        return self.k[:, :, :self.read_len], self.v[:, :, :self.read_len]

    monkeypatch.setattr(port_kv.KVCache, "update", update)
    with pytest.raises(neuron.NeuronBuildError, match="updated in place"):
        _build(tiny0_ckpt, tmp_path)


def test_rule_weights_must_be_exactly_what_the_graphs_read(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    real = neuron.assemble_rank_weights
    monkeypatch.setattr(neuron, "assemble_rank_weights",
                        lambda *a, **k: [{**w, "lm_head.bias": torch.zeros(3)} for w in real(*a, **k)])
    with pytest.raises(ValueError, match=r"not read by any graph \['lm_head.bias'\]"):
        _build(tiny0_ckpt, tmp_path)
    monkeypatch.setattr(neuron, "assemble_rank_weights",
                        lambda *a, **k: [{n: (t.t().contiguous() if n.endswith("o_proj.weight") else t)
                                          for n, t in w.items()} for w in real(*a, **k)])
    with pytest.raises(ValueError, match="wrong shape"):
        _build(tiny0_ckpt, tmp_path)


def test_rule_weight_shapes_are_checked_on_the_checkpoint_layout(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """With the decode graph as priority model the graphs' weights have the compiler's layout:
    checking against the metaneff shapes (the old _graph_io) would refuse the right weights."""
    from torch_neuronx.xla_impl.trace import get_torch_dtype

    def metaneff_shapes(self):
        weights, states = {}, {}
        for tag in self.kv_graphs:
            for t in self.nxd_model.get_metaneff(tag).input_tensors:
                target = weights if t.type.name == "INPUT_WEIGHT" else states if t.type.name == "INPUT_STATE" else None
                if target is not None:
                    target[neuron._checkpoint_key(t)] = (tuple(t.shape), get_torch_dtype(t.data_type))
        return weights, states

    monkeypatch.setattr(neuron.NeuronBackend, "_graph_io", metaneff_shapes)
    with pytest.raises(HarnessInputError, match="wrong shape"):
        _build(tiny0_ckpt, tmp_path, layout_priority="decode")


@pytest.mark.parametrize("flags,why", [
    ("--enable-saturate-infinity --model-type=transformer --target=inf2", "platform target"),
    ("--model-type=transformer --auto-cast=fp8 --target inf2", "invalid choice: 'fp8'"),
    ("--model-type=transformers --target inf2", "invalid choice: 'transformers'"),
    ("--model-type=transformer --no-such-flag --target inf2", "unrecognized arguments"),
])
def test_rule_compiler_flags_are_valid_neuronx_cc_options(nxd, tiny0_ckpt, tmp_path, monkeypatch, flags, why):
    for module in (neuron, neuron_cache):  # past our own check
        monkeypatch.setattr(module, "normalize_compiler_args", lambda args: flags.split())
    with pytest.raises(neuron.NeuronBuildError, match=why):
        _build(tiny0_ckpt, tmp_path)


def test_our_flag_check_refuses_the_equals_form_first(nxd, tiny0_ckpt, tmp_path):
    with pytest.raises(HarnessInputError, match="--target inf2"):
        _build(tiny0_ckpt, tmp_path, compiler_args="-O1 --target=inf2")


def test_lnc_from_the_named_platform(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """With lnc_size left to NxD, NxDParallelState asks the platform for its LNC: the platform the
    backend names for the build answers (inf2: 1)."""
    monkeypatch.setattr(neuron_build, "INF2_LNC", None)
    assert _build(tiny0_ckpt, tmp_path).compiled


def test_rule_no_graph_input_as_output(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(graphs, "HOST_CAPTURES", ())  # the parity graph returns `embeddings` again
    with pytest.raises(neuron.NeuronBuildError, match="graph input 'inputs_embeds'"):
        _build(tiny0_ckpt, tmp_path, capture=True)


def test_rule_shapes_are_fixed_by_the_example_inputs(nxd, tiny0_ckpt, tmp_path):
    be = _build(tiny0_ckpt, tmp_path)
    x = torch.zeros(1, 8, be.spec.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(KeyError):  # no graph was traced for 8 positions
        be.nxd_model(x, torch.arange(8, dtype=torch.int32)[None], torch.tensor([7], dtype=torch.int32))
    with pytest.raises(AssertionError, match="does not match"):
        be.nxd_model(x[:, :1], torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                     model_name="prefill_16_kv16")
    one = (x[:, :1], torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(AssertionError, match="must be provided"):  # decode at two KV buckets: same shapes
        be.nxd_model(*one)
    with pytest.raises(RuntimeError, match="traced with torch.int32"):
        be.nxd_model(x[:, :1], torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                     model_name="decode_kv16")


# ---- the import chain, the platform, SPMD replay, parameters, flags, cores ------------------------------

def test_rule_nxd_imports_only_with_the_fx_stand_in(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """NxD's import chain reaches transformers.utils.fx (absent in transformers 5): without the
    stand-in the backend cannot import NxD at all."""
    import importlib.util
    import sys

    if importlib.util.find_spec("transformers.utils.fx") is not None:
        pytest.skip("this transformers has transformers.utils.fx (4.x): nothing to stand in for")
    for name in [n for n in sys.modules if n.split(".")[0] == "neuronx_distributed"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(neuron_env, "_fx_stand_in", lambda: None)  # the fix removed
    with pytest.raises(ModuleNotFoundError, match="transformers.utils.fx"):
        _build(tiny0_ckpt, tmp_path)


def test_rule_the_build_names_its_platform(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """NxD asks the platform in initialize_model_parallel whatever lnc_size is: the backend names it
    (the flags' --target) for the build and puts the variable back afterwards."""
    import contextlib
    import os

    assert "NEURON_PLATFORM_TARGET_OVERRIDE" not in os.environ
    monkeypatch.setattr(neuron_build, "build_platform", lambda flags: contextlib.nullcontext())  # the fix removed
    with pytest.raises(neuron.NeuronBuildError, match="no Neuron device"):
        _build(tiny0_ckpt, tmp_path)
    monkeypatch.undo()
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with pytest.raises(HarnessInputError, match="contradicts the compiler flags' --target inf2"):
        _build(tiny0_ckpt, tmp_path)
    assert not any(p.name.startswith("perf") for p in tmp_path.iterdir())


def test_layout_priority_choices_and_the_layout_transformer(nxd, tiny0_ckpt, tmp_path):
    import os

    decode = _build(tiny0_ckpt, tmp_path, layout_priority="decode")
    assert decode.priority_key == "decode_kv16" and decode.nxd_model.layout_transformer["target"] == "inf2"
    assert "NEURON_PLATFORM_TARGET_OVERRIDE" not in os.environ  # set for the build only
    prefill = _build(tiny0_ckpt, tmp_path, layout_priority="prefill")
    none = _build(tiny0_ckpt, tmp_path)  # the default: no layout transform
    assert prefill.priority_key == "prefill_16_kv16" and none.nxd_model.layout_transformer is None
    assert len({decode.cache_key, prefill.cache_key, none.cache_key}) == 3
    x = torch.randn(1, 16, decode.spec.hidden_size).bfloat16()
    pos = torch.arange(16)[None]
    outs = [be.forward(x, pos, last=15)[0] for be in (decode, prefill, none)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # layout never changes numbers
    with pytest.raises(HarnessInputError, match="choose decode, prefill or none"):
        _build(tiny0_ckpt, tmp_path, layout_priority="tokens")


def test_a_load_that_fails_in_the_layout_transform_names_layout_priority_none(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """A core with room for the weights once but not twice: the transform's load fails naming the
    option that makes it fit, and without the transform the same build loads."""
    loaded = _build(tiny0_ckpt, tmp_path).nxd_model.device_memory  # the build without the transform
    # a core with room for that load and half the weights again, not for a second copy of them
    monkeypatch.setenv("NXD_DOUBLE_CORE_BYTES", str(loaded["total"] + loaded["weights"] // 2))
    with pytest.raises(neuron.NeuronBuildError, match="layout_priority=none"):
        _build(tiny0_ckpt, tmp_path, layout_priority="decode")
    assert _build(tiny0_ckpt, tmp_path).nxd_model.loaded_on_neuron


class PythonRankGather(torch.nn.Module):
    """A vocabulary-parallel lm_head whose gather places each rank's slice by the Python rank (module
    level: the compiled model pickles its module)."""

    def __init__(self, in_features, vocab_per_rank, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(vocab_per_rank, in_features, dtype=dtype))

    def forward(self, x):
        from neuronx_distributed.parallel_layers import parallel_state as ps

        local = torch.nn.functional.linear(x, self.weight)
        rank, n = ps.get_tensor_model_parallel_rank(), local.shape[-1]
        full = torch.zeros(*local.shape[:-1], n * ps.get_tensor_model_parallel_size(), dtype=local.dtype)
        return ps.all_reduce(full.index_copy(-1, torch.arange(n) + rank * n, local))


def test_rule_rank_dependent_python_is_baked_as_rank_0(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """One SPMD trace runs on every rank: a gather written with the Python rank (each rank writing
    its slice at rank * n) puts both slices at 0 on the device, though re-running forward per rank
    would have looked right."""
    healthy = _build(tiny0_ckpt, tmp_path)

    def vocab(self, in_features, vocab_per_rank):
        return PythonRankGather(in_features, vocab_per_rank, self.dtype)

    monkeypatch.setattr(neuron.NeuronLinears, "vocab", vocab)
    baked = _build(tiny0_ckpt, tmp_path / "baked")  # a test edit the source hash cannot see: its own cache
    assert baked.compiled
    x = torch.randn(1, 16, healthy.spec.hidden_size).bfloat16()
    pos = torch.arange(16)[None]
    want, got = healthy.forward(x, pos, last=15)[0], baked.forward(x, pos, last=15)[0]
    half = want.shape[-1] // 2
    assert torch.count_nonzero(got[..., half:]) == 0  # rank 1's slice never reached its place
    assert not torch.allclose(got[..., :half].float(), want[..., :half].float(), atol=1e-2)


def test_rule_parameters_are_never_state(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """A KV cache kept as Parameters and reassigned in forward is refused (not supported by NxD)."""
    real_init = port_kv.KVCache.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        for name in ("k", "v"):
            setattr(self, name, torch.nn.Parameter(self._buffers.pop(name), requires_grad=False))

    def update(self, positions, k, v):
        rows = port_kv.chunk_rows(positions)
        self.k = torch.nn.Parameter(self.k.index_copy(2, rows, k), requires_grad=False)
        self.v = torch.nn.Parameter(self.v.index_copy(2, rows, v), requires_grad=False)
        return self.k[:, :, :self.read_len], self.v[:, :, :self.read_len]

    monkeypatch.setattr(port_kv.KVCache, "__init__", init)
    monkeypatch.setattr(port_kv.KVCache, "update", update)
    with pytest.raises(neuron.NeuronBuildError, match="reassigned in forward"):
        _build(tiny0_ckpt, tmp_path)


NXDI_GEMMA3_FLAGS = ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1 "
                     "--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2' "
                     "--auto-cast=none --internal-enable-dge-levels vector_dynamic_offsets --target inf2")


def test_quoted_compiler_flags_reach_the_compiler_whole(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    be = _build(tiny0_ckpt, tmp_path, compiler_args=NXDI_GEMMA3_FLAGS)
    overlap = "--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2"
    assert overlap in be.compiler_args  # one word
    import shlex

    assert overlap in shlex.split(be.nxd_model.graphs["prefill_16_kv16"].compiler_flags)
    from harness.backends import neuron_cache

    monkeypatch.setattr(neuron_cache, "compiler_flag_string", " ".join)  # the old join: the value is cut in two
    with pytest.raises(neuron.NeuronBuildError, match="unrecognized arguments: --cc-pipeline-tiling-factor=2"):
        _build(tiny0_ckpt, tmp_path / "again", compiler_args=NXDI_GEMMA3_FLAGS)


def test_row_parallel_reduce_dtype_is_a_build_option(nxd, tiny0_ckpt, tmp_path):
    fp32 = _build(tiny0_ckpt, tmp_path)
    bf16 = _build(tiny0_ckpt, tmp_path, reduce_dtype=torch.bfloat16)
    assert fp32.cache_key != bf16.cache_key
    o_proj = bf16.nxd_model.traced_modules["decode_kv16"].layers[0].self_attn.o_proj
    assert o_proj.reduce_dtype == torch.bfloat16 and \
        fp32.nxd_model.traced_modules["decode_kv16"].layers[0].self_attn.o_proj.reduce_dtype == torch.float32


def test_a_core_list_smaller_than_tp_is_refused_before_any_build(nxd, tiny0_ckpt, tmp_path, monkeypatch, capsys):
    from harness.cli import main

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "3")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # a user's own list (xdist assigns its own)
    with pytest.raises(HarnessInputError, match=r"NEURON_RT_VISIBLE_CORES='3' names 1 NeuronCore\(s\) but tp=2"):
        _build(tiny0_ckpt, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert main(["check", "--model", "tiny", "--backend", "neuron", "--buckets", "16,256", "--kv-len", "256"]) == 2
    assert "NEURON_RT_VISIBLE_CORES='3' names 1" in capsys.readouterr().err


def test_decode_graphs_take_their_own_compiler_flags(nxd, tiny0_ckpt, tmp_path):
    """decode_compiler_args reach the decode graphs only (context encoding keeps compiler_args),
    change the cache key, and must name the same --target."""
    dge = ["--internal-enable-dge-levels", "vector_dynamic_offsets"]
    base = _build(tiny0_ckpt, tmp_path)
    split = _build(tiny0_ckpt, tmp_path, decode_compiler_args=neuron.shlex.join([*neuron.DEFAULT_COMPILER_ARGS, *dge]))
    assert split.cache_key != base.cache_key
    for tag, art in split.nxd_model.graphs.items():
        words = neuron.shlex.split(art.compiler_flags)
        assert ("vector_dynamic_offsets" in words) == tag.startswith("decode"), tag
    assert _build(tiny0_ckpt, tmp_path, decode_compiler_args=None).cache_key == base.cache_key
    with pytest.raises(HarnessInputError, match="--target inf2"):
        _build(tiny0_ckpt, tmp_path, decode_compiler_args="-O2")


def test_the_cache_key_holds_which_graph_gets_which_flags(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """The same two flag strings given to other graphs (here: context encoding at -O2, the rest at
    -O1) are other compiled graphs: the local artifact key holds the per-graph mapping."""
    base = _build(tiny0_ckpt, tmp_path)
    swapped = neuron_cache.per_graph_flags

    def swap(tags, compiler_args, decode_args):
        return swapped(tags, decode_args, compiler_args)

    monkeypatch.setattr(neuron, "per_graph_flags", swap)
    assert _build(tiny0_ckpt, tmp_path).cache_key != base.cache_key


def test_a_calibrating_build_records_the_device_memory_its_load_took(nxd, tiny0_ckpt, tmp_path, monkeypatch):
    """GEMMA_PARITY_CALIBRATE: each build records the device memory its load took on its fullest core,
    read from the driver's per-core counters before and after the load (the double counts every load
    on them as the driver does): a first build its whole load, a second build in the same process only
    its own (the first's bytes are still on the core), beside the plan's figure; `info --plan`'s
    calibration lines then say what was measured."""
    from harness.backends import neuron_calibration
    from harness.plan.calibration import describe, read_calibration

    sysfs, record = tmp_path / "sysfs", tmp_path / "calibration.json"
    monkeypatch.setattr(neuron_calibration, "SYSFS_ROOT", sysfs)
    monkeypatch.setenv("NXD_DOUBLE_SYSFS", str(sysfs))
    monkeypatch.setenv("GEMMA_PARITY_CALIBRATE", "1")
    monkeypatch.setenv("GEMMA_PARITY_CALIBRATION", str(record))
    first = _build(tiny0_ckpt, tmp_path / "cache")
    again = _build(tiny0_ckpt, tmp_path / "cache")  # the cached entry, loaded a second time beside the first
    builds = json.loads(record.read_text())["builds"]
    assert [b["device_bytes_after_load"] for b in builds] == [first.nxd_model.device_memory["total"],
                                                             again.nxd_model.device_memory["total"]]
    assert builds[0]["device_bytes_by_core"]["before"] is None  # no counters before the first load
    assert builds[1]["device_bytes_by_core"]["before"] == builds[0]["device_bytes_by_core"]["after"]
    # tp 2: both cores the build was given (NEURON_RT_VISIBLE_CORES: under xdist, this worker's pair)
    given = neuron_env.parse_visible_cores(os.environ["NEURON_RT_VISIBLE_CORES"])
    assert len(given) == 2 and set(builds[1]["device_bytes_by_core"]["after"]) == {str(c) for c in given}
    assert builds[1]["planned_core_bytes"] == again.build.core["total"]
    calibration = read_calibration(record)
    assert [d["after_load"] for d in calibration["device"]] == [b["device_bytes_after_load"] for b in builds]
    assert any("measured" in line and "after load" in line for line in describe(calibration))


def test_device_memory_is_read_from_the_drivers_counters_or_not_at_all(tmp_path, monkeypatch):
    """The driver's own device_mem counter when it keeps one, else its categories' sum; cores numbered
    device by device; no tree, or a tree laid out otherwise: None (nothing recorded, not a guess)."""
    from harness.backends import neuron_calibration as nc

    monkeypatch.setattr(nc, "SYSFS_ROOT", tmp_path)
    assert nc.device_bytes_in_use(2, environ={}) is None
    for device, cores in ((0, 2), (1, 2)):
        (tmp_path / f"neuron{device}").mkdir()
        (tmp_path / f"neuron{device}" / "core_count").write_text(f"{cores}\n")
    for core, parts in ((2, {"constants": 1000, "tensors": 24}), (3, {"total": 5000, "constants": 7})):
        mem = tmp_path / "neuron1" / f"neuron_core{core - 2}" / "stats" / "memory_usage" / "device_mem"
        for name, value in parts.items():
            (mem / name if name != "total" else mem).mkdir(parents=True, exist_ok=True)
            ((mem / name / "total") if name != "total" else mem / "total").write_text(f"{value}\n")
    assert nc.device_bytes_in_use(2, environ={"NEURON_RT_VISIBLE_CORES": "2-3"}) == {2: 1024, 3: 5000}
    assert nc.device_bytes_in_use(2, environ={}) is None  # cores 0 and 1 hold no counters: not a guess
