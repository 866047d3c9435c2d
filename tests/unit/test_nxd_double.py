"""The NxD contract double itself (tests/nxd_double): each rule it enforces refuses what breaks a
real build, and what it executes computes what the unsharded math computes. A toy two-layer module
at TP=2 is traced, compiled and run; the Neuron backend's end-to-end run is in
tests/parity/test_neuron_double.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch import nn

from harness.backends.neuron_env import import_neuronx_distributed
from tests.nxd_double import installed

FLAGS = "--model-type=transformer --target inf2"


@pytest.fixture
def sdk(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")  # this host has no Neuron device
    with installed(monkeypatch):
        yield import_neuronx_distributed()  # the backend's way in (see test_import_chain_*)


class Toy(nn.Module):
    """Column then row parallel (no gather in between), and a counter kept as device state."""

    def __init__(self):
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.up = ColumnParallelLinear(8, 16, bias=False, gather_output=False)
        self.down = RowParallelLinear(16, 8, bias=False, input_is_parallel=True)
        self.register_buffer("count", torch.zeros(1), persistent=False)

    def forward(self, x, step):
        self.count = self.count + step  # out of place: aliased state
        return self.down(self.up(x)) + self.count


def _compiled(nxd, tmp_path, module_cls=None, flags=FLAGS, **compile_kwargs):
    with nxd.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
        module = (module_cls or Toy)()
        builder = nxd.ModelBuilder(module)
        builder.trace(args=(torch.zeros(1, 4, 8), torch.ones(1)), tag="four")
        builder.trace(args=(torch.zeros(1, 1, 8), torch.ones(1)), tag="one")
        return builder.compile(compiler_workdir=str(tmp_path), compiler_args=flags, **compile_kwargs)


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    up, down = torch.randn(16, 8, generator=gen), torch.randn(8, 16, generator=gen)
    shards = [{"up.weight": up[8 * r:8 * (r + 1)].clone(), "down.weight": down[:, 8 * r:8 * (r + 1)].clone()}
              for r in range(2)]  # `count` is state, not a weight
    return up, down, shards


def test_the_double_is_not_importable_outside_a_test():
    assert importlib.util.find_spec("neuronx_distributed") is None
    assert importlib.util.find_spec("torch_neuronx") is None


def test_sharded_graph_computes_the_unsharded_math_with_state_across_calls(sdk, tmp_path):
    model = _compiled(sdk, tmp_path)
    up, down, shards = _weights()
    with pytest.raises(AssertionError, match="loaded on neuron"):
        model.read_from_neuron_buffer("count", 0)  # before to_neuron
    model.set_weights(shards)
    model.to_neuron()
    assert model.read_from_neuron_buffer("count", 1).item() == 0  # states start zero
    x = torch.randn(1, 4, 8)
    for call in (1, 2):
        out = model(x, torch.full((1,), 0.5))
        want = x @ up.T @ down.T + 0.5 * call
        assert torch.allclose(out, want, atol=1e-4), call
    assert [model.read_from_neuron_buffer("count", r).item() for r in (0, 1)] == [1.0, 1.0]
    model.write_to_neuron_buffer(torch.zeros(1), "count", 0)
    with pytest.raises(KeyError, match="shape"):
        model.write_to_neuron_buffer(torch.zeros(2), "count", 0)
    with pytest.raises(KeyError):
        model.read_from_neuron_buffer("up->weight", 0)  # keyed by the raw checkpoint key only
    assert model(x[:, :1], torch.zeros(1), model_name="one").shape == (1, 1, 8)


class Scaled(Toy):
    """Toy whose output scale is a Python attribute: a trace bakes in the value it had then."""

    scale = 1.0

    def forward(self, x, step):
        self.count = self.count + step
        return self.scale * self.down(self.up(x)) + self.count


def test_each_tag_runs_its_module_as_traced_and_shares_the_state(sdk, tmp_path):
    """Two traces of the same shapes with the Python state changed between them are two graphs (the
    call must name one); changing the module after tracing changes neither; state is shared."""
    with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
        module = Scaled()
        builder = sdk.ModelBuilder(module)
        for tag, scale in (("x1", 1.0), ("x3", 3.0)):
            module.scale = scale
            builder.trace(args=(torch.zeros(1, 4, 8), torch.ones(1)), tag=tag)
        module.scale = 100.0
        model = builder.compile(compiler_workdir=str(tmp_path), compiler_args=FLAGS)
    up, down, shards = _weights()
    model.set_weights(shards)
    model.to_neuron()
    x, step = torch.randn(1, 4, 8), torch.full((1,), 0.5)
    with pytest.raises(AssertionError, match="must be provided"):
        model(x, step)
    with pytest.raises(AssertionError, match="does not match"):
        model(x, step, model_name="x2")
    plain = x @ up.T @ down.T
    assert torch.allclose(model(x, step, model_name="x1"), plain + 0.5, atol=1e-4)
    assert torch.allclose(model(x, step, model_name="x3"), 3 * plain + 1.0, atol=1e-4)  # count is shared


def test_the_metaneff_names_weights_and_states(sdk, tmp_path):
    from torch_neuronx.proto import metaneff_pb2

    meta = _compiled(sdk, tmp_path).get_metaneff("four")
    kinds = {t.checkpoint_key or t.user_input_key: t.type for t in meta.input_tensors}
    Type = metaneff_pb2.MetaTensor.Type
    assert kinds == {b"x": Type.USER_INPUT, b"step": Type.USER_INPUT, b"up.weight": Type.INPUT_WEIGHT,
                     b"down.weight": Type.INPUT_WEIGHT, b"count": Type.INPUT_STATE}


def test_set_weights_takes_exactly_what_the_graphs_read(sdk, tmp_path):
    model = _compiled(sdk, tmp_path)
    _, _, shards = _weights()
    bad = {
        "one dict for two ranks": [shards[0]],
        "missing": [{k: v for k, v in s.items() if k != "down.weight"} for s in shards],
        "not read by any graph": [{**s, "extra.weight": torch.zeros(1)} for s in shards],
        "state passed as a weight": [{**s, "count": torch.zeros(1)} for s in shards],
        "wrong shape": [{**s, "up.weight": s["up.weight"].reshape(4, 16)} for s in shards],
        "wrong dtype": [{**s, "up.weight": s["up.weight"].bfloat16()} for s in shards],
    }
    for why, weights in bad.items():
        with pytest.raises(ValueError):
            model.set_weights(weights)
    with pytest.raises(RuntimeError, match="set_weights"):
        model.to_neuron()
    with pytest.raises(RuntimeError, match="set_weights"):
        model(torch.zeros(1, 4, 8), torch.ones(1))
    model.set_weights(shards)
    model.to_neuron()
    with pytest.raises(ValueError, match="already loaded"):
        model.set_weights(shards)


def test_trace_refuses_illegal_forward_signatures(sdk):
    class Defaults(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    class Star(nn.Module):
        def forward(self, x, *rest):
            return x

    class Required(nn.Module):
        def forward(self, x, y, z=None):
            return x + y

    with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
        with pytest.raises(ValueError, match="non-None default"):
            sdk.ModelBuilder(Defaults()).trace(args=(torch.zeros(2),))
        with pytest.raises(NotImplementedError, match=r"\*args"):
            sdk.ModelBuilder(Star()).trace(args=(torch.zeros(2),))
        with pytest.raises(ValueError, match="Missing required"):
            sdk.ModelBuilder(Required()).trace(args=(torch.zeros(2),))
        with pytest.raises(ValueError, match="Too many"):
            sdk.ModelBuilder(Required()).trace(args=(torch.zeros(2),) * 4)
        sdk.ModelBuilder(Required()).trace(args=(torch.zeros(2), torch.zeros(2)))  # z=None may be left out


@pytest.mark.parametrize("body,why", [
    ("in_place", "updated in place"), ("dtype", "changed from"), ("input_out", "graph input 'x'")])
def test_trace_refuses_state_misuse_and_inputs_returned(sdk, body, why):
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(3), persistent=False)

        def forward(self, x):
            if body == "in_place":
                self.cache.add_(1)
            elif body == "dtype":
                self.cache = self.cache.double() + 1
            else:
                return x, x + 1
            return x + 1

    with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
        with pytest.raises(RuntimeError, match=why):
            sdk.ModelBuilder(Bad()).trace(args=(torch.zeros(3),))


def test_parallel_layers_divide_full_sizes_and_shard_weights(sdk):
    from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear

    with pytest.raises(AssertionError, match="not initialized"):
        ColumnParallelLinear(8, 16)  # parallel layers need the parallel state
    with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
        col, row = ColumnParallelLinear(8, 16, bias=True, gather_output=True), RowParallelLinear(16, 8)
        assert col.weight.shape == (8, 8) and col.bias.shape == (16,) and row.weight.shape == (8, 8)
        assert ColumnParallelLinear(8, 16, gather_output=False).bias.shape == (8,)
        assert col.reduce_dtype == row.reduce_dtype == torch.float32 and col.weight.dtype == torch.float32
        with pytest.raises(AssertionError, match="divisible"):
            ColumnParallelLinear(8, 15)
        with pytest.raises(NotImplementedError):
            RowParallelLinear(16, 8, sequence_parallel_enabled=True)


def test_gather_output_and_split_input_on_two_ranks(sdk, tmp_path):
    from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear

    class GatherSplit(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = ColumnParallelLinear(8, 16, bias=False, gather_output=True)  # full 16 on each rank
            self.down = RowParallelLinear(16, 8, bias=False, input_is_parallel=False, reduce_dtype=torch.bfloat16)
            self.register_buffer("count", torch.zeros(1), persistent=False)

        def forward(self, x, step):
            self.count = self.count + step
            return self.down(self.up(x))

    model = _compiled(sdk, tmp_path, GatherSplit)
    up, down, shards = _weights(1)
    model.set_weights(shards)
    model.to_neuron()
    x = torch.randn(1, 4, 8)
    out = model(x, torch.ones(1))
    # One SPMD trace made as rank 0 runs on every rank: input_is_parallel=False splits the input by
    # the Python rank (upstream _split_along_dim), so every rank keeps rank 0's half of `h`, while
    # each multiplies its own weight shard and the all-reduce (in bf16, reduce_dtype) sums them.
    h = x @ up.T
    baked = (h[..., :8] @ down[:, :8].T + h[..., :8] @ down[:, 8:].T).bfloat16().float()
    assert torch.allclose(out, baked, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(out, h @ down.T, rtol=0.1, atol=0.1)  # not what each rank re-run would give


class PerRankReduce(nn.Module):
    """A plain parameter holding each rank's own slice (as the MoE experts hold theirs, set per rank
    by set_weights), reduced and gathered through the backend's NxDCollectives (NxD's mappings)."""

    reduce_dtype = torch.float32

    def __init__(self):
        from harness.backends.neuron_layers import NxDCollectives

        super().__init__()
        self.up = nn.Parameter(torch.zeros(8, 8))  # [out, in]: a whole matrix per rank, unlike a parallel layer
        self.collectives = NxDCollectives(self.reduce_dtype)
        self.register_buffer("count", torch.zeros(1), persistent=False)

    def forward(self, x, step):
        self.count = self.count + step
        part = nn.functional.linear(x, self.up)
        return self.collectives.all_reduce(part), self.collectives.all_gather(part, dim=1)


class PerRankReduceBf16(PerRankReduce):
    reduce_dtype = torch.bfloat16


def test_nxd_mappings_reduce_and_gather_per_rank_weights(sdk, tmp_path):
    """Each rank's own slice reaches its rank, and NxD's all-reduce sums the ranks' partial results
    (in the reduce dtype: bf16 partial sums give bf16's rounding), its all-gather concatenates them."""
    x = torch.randn(1, 4, 8)
    _, _, shards = _weights(2)
    parts = [x @ shard["up.weight"].T for shard in shards]  # each rank's own [8, 8]
    for module_cls in (PerRankReduce, PerRankReduceBf16):
        model = _compiled(sdk, tmp_path / module_cls.__name__, module_cls)
        model.set_weights([{"up": s["up.weight"]} for s in shards])
        model.to_neuron()
        reduced, gathered = model(x, torch.ones(1))
        assert torch.equal(gathered, torch.cat(parts, dim=1))
        want = (parts[0].to(module_cls.reduce_dtype) + parts[1].to(module_cls.reduce_dtype)).float()
        assert torch.equal(reduced, want), module_cls.__name__
    assert not torch.equal(parts[0].bfloat16().float() + parts[1].bfloat16().float(), parts[0] + parts[1])
    from neuronx_distributed.parallel_layers import mappings

    with pytest.raises(NotImplementedError, match="process_group=None"):
        mappings.reduce_from_tensor_model_parallel_region(x, process_group=object())


def test_save_and_load_keep_the_graphs_not_the_weights(sdk, tmp_path):
    model = _compiled(sdk, tmp_path)
    _, _, shards = _weights()
    model.save(str(tmp_path / "m.pt"))
    again = type(model).load(str(tmp_path / "m.pt"))
    with pytest.raises(RuntimeError, match="set_weights"):
        again.to_neuron()
    for m in (model, again):
        m.set_weights(shards)
        m.to_neuron()
    x = torch.randn(1, 4, 8)
    assert torch.equal(model(x, torch.ones(1)), again(x, torch.ones(1)))


def test_compile_arguments_and_default_flags(sdk, tmp_path):
    model = _compiled(sdk, tmp_path, flags=None)  # NxD's defaults carry no --target: the override's platform
    assert "--target" not in model.graphs["four"].compiler_flags and model.graphs["four"].neff
    with pytest.raises(ValueError, match="priority_model_key"):
        _compiled(sdk, tmp_path, priority_model_key="nope")
    with pytest.raises(ValueError, match="Missing compiler args"):
        _compiled(sdk, tmp_path, flags={"four": FLAGS})
    model = _compiled(sdk, tmp_path, priority_model_key="one")
    assert "--enable-internal-neff-wrapper" in model.graphs["one"].compiler_flags
    assert "-O1" in model.graphs["four"].compiler_flags and "--verbose=35" in model.graphs["four"].compiler_flags
    shapes = [t.shape for t in model.get_metaneff("four").input_tensors if t.checkpoint_key == b"up.weight"]
    assert shapes == [[8, 8]] and model.graphs["four"].weights["down.weight"][0] == (8, 8)
    assert (tmp_path / "four").is_dir()  # compiler_workdir/<tag>/<timestamp>/log-neuron-cc.txt
    assert list((tmp_path / "four").glob("*/log-neuron-cc.txt"))


def test_default_flags_on_an_inf2_host(sdk, tmp_path, monkeypatch):
    import torch_neuronx.utils

    monkeypatch.setattr(torch_neuronx.utils, "HOST_PLATFORM", "inf2")
    model = _compiled(sdk, tmp_path, flags=None)
    flags = model.graphs["four"].compiler_flags.split()
    assert flags[:4] == ["--enable-saturate-infinity", "--auto-cast=none", "--model-type=transformer", "-O1"]


def test_lnc_comes_from_the_platform_unless_given(sdk, monkeypatch):
    import torch_neuronx.utils

    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    with pytest.raises(RuntimeError, match="no Neuron device"):
        sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2)
    assert sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1).lnc_size == 1
    monkeypatch.setattr(torch_neuronx.utils, "HOST_PLATFORM", "trn2")
    assert sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2).lnc_size == 2
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2).lnc_size == 1


def test_a_builder_made_outside_the_parallel_state_has_one_rank(sdk, tmp_path):
    class Plain(nn.Module):
        def forward(self, x):
            return x * 2

    builder = sdk.ModelBuilder(Plain())
    builder.trace(args=(torch.zeros(2),), tag="t")
    model = builder.compile(compiler_workdir=str(tmp_path), compiler_args=FLAGS)
    with pytest.raises(ValueError, match="list of 1"):
        model.set_weights([{}, {}])


# ---- the import chain: neuronx_distributed -> pipeline -> transformers.utils.fx ---------------------

NO_FX = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec(
    "transformers.utils.fx") is None


@pytest.mark.skipif(not NO_FX, reason="this transformers has transformers.utils.fx (4.x): nothing to stand in for")
def test_plain_import_fails_as_upstream_and_the_backend_import_works(monkeypatch):
    from harness.backends import neuron_env

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    with installed(monkeypatch):
        with pytest.raises(ModuleNotFoundError) as info:
            import neuronx_distributed  # noqa: F401
        assert info.value.name == "transformers.utils.fx"
        nxd = import_neuronx_distributed()
        assert nxd.ModelBuilder and nxd.pipeline.trace.TRANSFORMERS_AVAILABLE
        assert neuron_env.FX_MODULE not in sys.modules  # the stand-in lived only during the import
        with pytest.raises(NotImplementedError, match="HFTracer does not exist"):
            nxd.pipeline.trace.HFTracerWrapper()
        assert import_neuronx_distributed() is nxd


def test_a_real_transformers_utils_fx_is_used_and_kept(monkeypatch):
    """With transformers 4.x (modelled: a real module at transformers.utils.fx) no stand-in is made."""
    import types

    fx = types.ModuleType("transformers.utils.fx")

    class HFTracer:
        pass

    fx.HFTracer = HFTracer
    monkeypatch.setitem(sys.modules, "transformers.utils.fx", fx)
    with installed(monkeypatch):
        nxd = import_neuronx_distributed()
        assert nxd.pipeline.trace.HFTracerWrapper.__mro__[1] is HFTracer
        assert sys.modules["transformers.utils.fx"] is fx


# ---- the platform: asked on every initialize_model_parallel and by the layout transformer -------------

def test_initialize_model_parallel_asks_the_platform_every_call(sdk, monkeypatch):
    import torch_neuronx.utils

    before = len(torch_neuronx.utils.QUERIES)
    for _ in range(2):
        with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
            pass
    assert torch_neuronx.utils.QUERIES[before:] == [None, None]  # lnc_size given: asked anyway
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    with pytest.raises(RuntimeError, match="no Neuron device"):
        sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1).__enter__()
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf3")
    with pytest.raises(RuntimeError, match="not a supported platform"):
        sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1).__enter__()
    monkeypatch.setattr(torch_neuronx.utils, "HOST_PLATFORM", "inf2")  # on the device host itself
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
        pass


def test_layout_transformer_needs_the_platform_and_is_none_when_nothing_changes(sdk, tmp_path, monkeypatch):
    model = _compiled(sdk, tmp_path, priority_model_key="one")
    assert model.layout_transformer["weights"] == ["down.weight", "up.weight"]
    assert model.layout_transformer["target"] == "inf2"
    assert _compiled(sdk, tmp_path).layout_transformer is None  # no priority model: no optimisation

    class Vector(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.scale

    def build(module, priority="t", skip=None):
        with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
            builder = sdk.ModelBuilder(module, weights_to_skip_layout_optimization=skip)
            builder.trace(args=(torch.zeros(2, 8),), tag="t")
            monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
            return builder.compile(priority_model_key=priority, compiler_workdir=str(tmp_path), compiler_args=FLAGS)

    assert build(Vector()).layout_transformer is None  # nothing to re-lay out: nothing compiled, no platform asked
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    assert build(nn.Linear(8, 8, bias=False), skip={"weight"}).layout_transformer is None
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    with pytest.raises(RuntimeError, match="Compilation process failed") as info:
        build(nn.Linear(8, 8, bias=False))  # the transformer's flags name no target; no override now
    assert "no Neuron device" in str(info.value.__cause__)


# ---- parameters are weights, never state -------------------------------------------------------------

def test_parameter_reassigned_in_forward_is_refused(sdk):
    class Reassign(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3), requires_grad=False)

        def forward(self, x):
            self.w = nn.Parameter(self.w + x, requires_grad=False)
            return x * 2

    with sdk.NxDParallelState(world_size=2, tensor_model_parallel_size=2, lnc_size=1):
        with pytest.raises(RuntimeError, match="parameter w was reassigned in forward"):
            sdk.ModelBuilder(Reassign()).trace(args=(torch.zeros(3),))


# ---- the compiler's flag vocabulary -----------------------------------------------------------------

GEMMA3_FLAGS = ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1"
                " --tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2'"
                " --auto-cast=none --internal-enable-dge-levels vector_dynamic_offsets"
                " --internal-hlo2tensorizer-options='--verify-hlo=true' --target inf2")


def test_the_documented_flags_are_accepted(sdk):
    import libneuronxla

    args = libneuronxla.parse_flags(GEMMA3_FLAGS)
    assert args.tensorizer_options == "--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2"
    assert args.internal_enable_dge_levels == ["vector_dynamic_offsets"] and args.model_type == "transformer"
    assert libneuronxla.parse_flags("--model-type=transformer --lnc=1 --internal-hlo2tensorizer-options="
                                    "'--experimental-unsafe-fp8e4m3fn-as-fp8e4m3 --verify-hlo=true' --verbose=35")


@pytest.mark.parametrize("flags,why", [
    ("-O1 --no-such-flag", "unrecognized arguments: --no-such-flag"),
    ("-O1 --internal-no-such-option 3", "unrecognized arguments"),
    ("--internal-enable-dge-levels vector_offsets", "invalid choice: 'vector_offsets'"),
    # the quoted value cut at its space (a plain ' '.join of the words): the second half is a flag of its own
    ("--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2",
     "unrecognized arguments: --cc-pipeline-tiling-factor=2"),
    ("--tensorizer-options='--enable-ccop-compute-overlap --no-such-pass'", "unrecognized arguments: --no-such-pass"),
    ("--tensorizer-options='--cc-pipeline-tiling-factor=3'", "invalid choice: 3"),
    ("-O1 --tensorizer-options='--enable-ccop-compute-overlap", "No closing quotation"),
])
def test_unknown_flags_and_values_are_refused(sdk, flags, why):
    import libneuronxla

    with pytest.raises(libneuronxla.CompilerError, match=why):
        libneuronxla.parse_flags(flags)
