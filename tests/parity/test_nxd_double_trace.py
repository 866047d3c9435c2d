"""The NxD double is no more lenient than a trace (tests/nxd_double/sdk/neuronx_distributed/trace/fixed.py): a graph
takes the Python branches and plain tensor attributes of its trace on every call, every graph runs
on the one state the first graph initialises, and a trace needs an input tensor."""

from __future__ import annotations

import pytest
import torch

from tests.nxd_double import installed


@pytest.fixture(scope="module")
def nxd():
    from harness.backends.neuron_env import import_neuronx_distributed

    with pytest.MonkeyPatch.context() as mp, installed(mp, host_platform="inf2"):
        yield import_neuronx_distributed()


class Branchy(torch.nn.Module):
    """Doubles a positive-sum input, triples any other: a Python branch on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.scale * (2.0 if x.sum() > 0 else 3.0)


class Remembers(torch.nn.Module):
    """Adds the previous call's input, kept in a plain tensor attribute (no buffer, no state)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.previous = torch.zeros(4)

    def forward(self, x):
        out = x * self.scale + self.previous
        self.previous = x.detach().clone()
        return out


class Cached(torch.nn.Module):
    """A KV-like state of `slots` slots, rewritten out of place (aliased state)."""

    def __init__(self, slots):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("cache", torch.zeros(slots, 4), persistent=False)

    def forward(self, x):
        self.cache = self.cache + x.sum()
        return x * self.scale + self.cache.sum()


def _compiled(nxd, module, tmp_path, *traces):
    with nxd.NxDParallelState(world_size=1, tensor_model_parallel_size=1, lnc_size=1):
        builder = nxd.ModelBuilder(module)
        for tag, example in traces:
            builder.trace(args=example, tag=tag)
        model = builder.compile(compiler_workdir=str(tmp_path), compiler_args="--target inf2")
    model.set_weights([{"scale": torch.ones(1)}])
    model.to_neuron()
    return model


def test_a_python_branch_is_the_one_the_trace_took(nxd, tmp_path):
    model = _compiled(nxd, Branchy(), tmp_path, ("g", torch.ones(4)))
    x = -torch.ones(4)
    assert torch.equal(model(x), 2 * x)  # eager Python would triple it: the trace fixed the branch
    assert torch.equal(Branchy()(x), 3 * x)


def test_a_plain_tensor_attribute_is_a_constant_of_the_trace(nxd, tmp_path):
    model = _compiled(nxd, Remembers(), tmp_path, ("g", torch.ones(4)))
    first, second = torch.full((4,), 5.0), torch.full((4,), 7.0)
    assert torch.equal(model(first), first)  # previous was zeros when traced
    assert torch.equal(model(second), second)  # not first: the graph never reads a later value


def test_graphs_with_differing_state_shapes_are_refused(nxd, tmp_path):
    module = Cached(8)
    with nxd.NxDParallelState(world_size=1, tensor_model_parallel_size=1, lnc_size=1):
        builder = nxd.ModelBuilder(module).trace(args=torch.ones(4), tag="small")
        module.cache = torch.zeros(16, 4)
        builder.trace(args=torch.ones(2, 4)[0], tag="large")
        with pytest.raises(ValueError, match="same state shapes"):
            builder.compile(compiler_workdir=str(tmp_path), compiler_args="--target inf2")


def test_same_state_shapes_compile_and_share_the_state(nxd, tmp_path):
    model = _compiled(nxd, Cached(8), tmp_path, ("a", torch.ones(4)), ("b", torch.ones(1, 4)))
    model(torch.ones(4), model_name="a")
    assert torch.equal(model.read_from_neuron_buffer("cache", 0), torch.full((8, 4), 4.0))
    model(torch.ones(1, 4), model_name="b")
    assert torch.equal(model.read_from_neuron_buffer("cache", 0), torch.full((8, 4), 8.0))


def test_a_trace_without_an_input_is_refused(nxd):
    class Optional(torch.nn.Module):
        def forward(self, x=None):
            return torch.ones(1)

    with nxd.NxDParallelState(world_size=1, tensor_model_parallel_size=1, lnc_size=1):
        with pytest.raises(ValueError, match="At least one input tensor"):
            nxd.ModelBuilder(Optional()).trace(args=None, tag="g")


class Reader(torch.nn.Module):
    """Writes its cache from `write` (state) or, given `read`, reads it, carrying it as state only
    when `carry`: two input signatures of one forward, routed by the names given (as upstream)."""

    def __init__(self, carry: bool):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("cache", torch.zeros(4), persistent=False)
        self.carry = carry

    def forward(self, write=None, read=None):
        if write is not None:
            self.cache = self.cache + write
            return write * self.scale
        if self.carry:
            self.cache = self.cache * 1
        return read * self.scale + self.cache


@pytest.mark.parametrize("carry", [True, False])
def test_a_graph_reading_a_buffer_it_does_not_reassign_reads_its_trace_time_value(nxd, tmp_path, carry):
    """A graph holding only some of the states is accepted (upstream NxDModel.add checks no later graph
    against the first's StateInitializer); a buffer it never reassigns is a constant of its trace, so
    it never sees what the other graph wrote (harness/port/draft_graphs.py carries the KV cache)."""
    module = Reader(carry)
    with nxd.NxDParallelState(world_size=1, tensor_model_parallel_size=1, lnc_size=1):
        builder = nxd.ModelBuilder(module).trace(kwargs={"write": torch.ones(4)}, tag="write")
        builder.trace(kwargs={"read": torch.ones(4)}, tag="read")
        model = builder.compile(compiler_workdir=str(tmp_path), compiler_args="--target inf2")
    model.set_weights([{"scale": torch.ones(1)}])
    model.to_neuron()
    model(write=torch.full((4,), 3.0))
    assert torch.equal(model(read=torch.zeros(4)), torch.full((4,), 3.0 if carry else 0.0))
