"""Run settings and the backend interface: one dtype vocabulary for every command, defaults written
once, backend options declared (an unknown one is refused, naming it), capabilities stated rather
than probed, one cache-read path."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from harness.backends import BACKENDS, Backend, backend_class, backend_options, build_engine, make_backend
from harness.base.errors import HarnessInputError, OptionError
from harness.cli import build_parser, main
from harness.cli.common import EXIT_BAD_INPUT
from harness.port.engine import Engine
from harness.base.settings import (DEFAULT_BUCKETS, DEFAULT_KV_LEN, DEFAULT_TP, RunSettings, dtype_name,
                                   parse_backend_options, parse_buckets, short_dtype_name, torch_dtype)

ALIASES = [("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp32", "float32"), ("float32", "float32")]
CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
TINY_CONFIG, CONFIG_12B = CONFIGS / "gemma-4-tiny.json", CONFIGS / "gemma-4-12b-it.json"


# ---- the vocabulary and the settings object --------------------------------------------------------

@pytest.mark.parametrize("given, canonical", [*ALIASES, (torch.bfloat16, "bfloat16"), (torch.float32, "float32"),
                                              ("torch.float32", "float32")])
def test_every_name_of_a_dtype_means_the_same(given, canonical):
    assert dtype_name(given) == canonical
    assert torch_dtype(given) == {"bfloat16": torch.bfloat16, "float32": torch.float32}[canonical]
    assert short_dtype_name(given) == {"bfloat16": "bf16", "float32": "fp32"}[canonical]
    assert RunSettings(dtype=given).dtype == canonical


@pytest.mark.parametrize("bad", ["int8", "float16", "fp16", "BF16", "", None, 16, torch.float16])
def test_a_dtype_outside_the_vocabulary_is_refused_by_name(bad):
    with pytest.raises(OptionError, match=r"--dtype .*unknown dtype; use one of bf16, bfloat16, float32, fp32"):
        dtype_name(bad)


def test_settings_normalise_and_copy():
    s = RunSettings(buckets=(256, 64, 64), dtype="fp32", backend_options={"a": 1})
    assert (s.buckets, s.dtype, s.torch_dtype, s.short_dtype) == ((64, 256), "float32", torch.float32, "fp32")
    changed = s.but(tp=1, backend_options={})
    assert (changed.tp, dict(changed.backend_options), s.tp, dict(s.backend_options)) == (1, {}, 2, {"a": 1})
    with pytest.raises(TypeError):
        s.backend_options["b"] = 2  # the settings are frozen, their options too
    with pytest.raises(OptionError, match="positive bucket"):
        RunSettings(buckets=(0, 64))


def test_defaults_are_the_published_port():
    assert (DEFAULT_TP, DEFAULT_KV_LEN, DEFAULT_BUCKETS) == (2, 256, (64, 256))
    assert RunSettings() == RunSettings(backend="cpu", tp=2, dtype="bf16", buckets=(64, 256), kv_len=256)


@pytest.mark.parametrize("text, expected", [("16,64", (16, 64)), ("64, 16,16", (16, 64)), ("8,", (8,))])
def test_buckets_parse(text, expected):
    assert parse_buckets(text) == expected


@pytest.mark.parametrize("text", ["", "16,x", "0,16", "-4"])
def test_bad_buckets_are_refused(text):
    with pytest.raises(OptionError, match="--buckets"):
        parse_buckets(text)


@pytest.mark.parametrize("pairs, message", [(["nothing"], "expected KEY=VALUE"), (["=3"], "expected KEY=VALUE"),
                                            (["a=1", "a=2"], "given twice")])
def test_bad_backend_option_syntax_is_refused(pairs, message):
    with pytest.raises(OptionError, match=message):
        parse_backend_options(pairs)


# ---- the backend interface -------------------------------------------------------------------------

def test_backend_options_are_declared_and_converted():
    assert parse_backend_options(["compile-workers=4", "zero_on_reset=false"]) == {
        "compile_workers": "4", "zero_on_reset": "false"}
    converted = backend_options("neuron", {"compile_workers": "4", "zero_on_reset": "false", "cache_dir": "/x"})
    assert converted == {"compile_workers": 4, "zero_on_reset": False, "cache_dir": Path("/x")}
    with pytest.raises(OptionError, match=r"compile_workers='0': must be at least 1"):
        backend_options("neuron", {"compile_workers": "0"})
    with pytest.raises(OptionError, match=r"zero_on_reset='maybe': expected true or false"):
        backend_options("neuron", {"zero_on_reset": "maybe"})


@pytest.mark.parametrize("name", BACKENDS, ids=lambda name: f"{name}-backend")  # not the neuron marker
def test_an_unknown_backend_option_is_refused_naming_it(name):
    with pytest.raises(OptionError, match=rf"--backend-option compile_worker: the {name} backend has no such option"):
        backend_options(name, {"compile_worker": 4})


def test_an_unknown_backend_is_refused():
    with pytest.raises(OptionError, match="--backend 'tpu': unknown backend"):
        backend_class("tpu")


@pytest.mark.parametrize("name", BACKENDS, ids=lambda name: f"{name}-backend")  # not the neuron marker
def test_constructors_take_settings_and_only_their_declared_options(name):
    """No **kwargs that would swallow a misspelt option: the keyword options of each constructor are
    exactly what it declares in OPTIONS (and `assistant`, the opened settings.assistant, where it
    drafts on its device), and the capabilities are stated on the class or set in __init__ (never probed)."""
    cls = backend_class(name)
    params = inspect.signature(cls.__init__).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), name
    assert list(params)[:4] == ["self", "checkpoint", "settings", "capture"]
    assert set(list(params)[4:]) == set(cls.OPTIONS) | ({"assistant"} if cls.drafts_on_device else set())
    source = inspect.getsource(cls)
    for capability in ("returns_captures", "last_row_only", "reads_cache", "host_ranks", "drafts_on_device"):
        assert capability in source, (name, capability)


def test_cpu_backend_implements_the_interface(tiny0_ckpt):
    settings = RunSettings(buckets=(16,), kv_len=32)
    backend = make_backend(tiny0_ckpt, settings)
    assert isinstance(backend, Backend)
    assert (backend.returns_captures, backend.last_row_only, backend.reads_cache, backend.host_ranks) == (
        True, False, True, True)
    x = torch.randn(1, 16, tiny0_ckpt.spec.hidden_size).to(torch.bfloat16)
    logits, captures = backend.forward(x, torch.arange(16)[None])
    assert logits.shape == (1, 16, tiny0_ckpt.spec.vocab_size) and captures == {}
    last, captures = backend.forward(x, torch.arange(16)[None], capture=True, last=5)
    assert torch.equal(last, logits[:, 5:6]) and "layers.0.output" in captures


def test_engine_reads_the_cache_through_the_one_merge(tiny0_ckpt, monkeypatch):
    """Engine.read_cache is the one path: it merges the backend's per-rank caches with
    rank_merge.merge_rank_caches, and a backend that says it cannot read its cache is refused."""
    from harness.port import engine as port_engine

    engine = build_engine(tiny0_ckpt, RunSettings(buckets=(16,), kv_len=32))
    engine.prefill(list(range(3, 12)))
    calls = []
    real = port_engine.merge_rank_caches
    monkeypatch.setattr(port_engine, "merge_rank_caches", lambda *a: calls.append(a) or real(*a))
    cache = engine.read_cache(9)
    assert len(calls) == 1 and len(cache) == tiny0_ckpt.spec.num_layers and cache[0][0].shape[1] == 9
    monkeypatch.setattr(engine.backend, "reads_cache", False)
    with pytest.raises(HarnessInputError, match="cannot read its KV cache"):
        engine.read_cache(9)


class PerfBuild:
    """A backend double: a perf build (no captures, last row only)."""

    name, returns_captures, last_row_only, reads_cache, host_ranks, tp = "double", False, True, False, False, 2

    def __init__(self, vocab):
        self.vocab, self.calls = vocab, []

    def reset(self):
        pass

    def forward(self, inputs_embeds, positions, capture=False, last=None, verify=False):  # the Backend protocol's
        self.calls.append(last)
        return torch.zeros(1, 1, self.vocab), {}


def test_engine_asks_a_perf_build_for_the_last_row_and_refuses_captures_of_it(tiny0_ckpt):
    spec = tiny0_ckpt.spec
    backend = PerfBuild(spec.vocab_size)
    engine = Engine(spec, backend, tiny0_ckpt.embed_weight(torch.bfloat16), RunSettings(buckets=(16,), kv_len=32))
    assert engine.prefill([5, 6, 7]).logits.shape == (1, spec.vocab_size) and backend.calls == [2]
    step = engine.decode_step(9, 3)
    assert step.logits.shape == (spec.vocab_size,) and step.captures == {}
    with pytest.raises(HarnessInputError, match="built without captures"):
        engine.prefill([5, 6, 7], capture=True)


# ---- every command: the same vocabulary, and the settings reach the library ------------------------

class Reached(Exception):
    """Raised by a stand-in for the library function a command calls, carrying what it was given."""


def _reach(monkeypatch, target: str, pick):
    module, _, name = target.rpartition(".")

    def stand_in(*args, **kwargs):
        raise Reached(pick(*args, **kwargs))

    monkeypatch.setattr(__import__(module, fromlist=[name]), name, stand_in)


def _run_command(argv) -> object:
    """Parse, validate and run a command as main does, up to the library call the stand-in stops."""
    args = build_parser().parse_args([str(a) for a in argv])
    args.validate(args)
    with pytest.raises(Reached) as reached:
        args.func(args)
    return reached.value.args[0]


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory, tiny0_ckpt):
    from tests.inputs.scenarios import small_golden

    return small_golden(tmp_path_factory.mktemp("golden") / "g", tiny0_ckpt)


@pytest.mark.parametrize("alias, canonical", ALIASES)
def test_check_takes_every_dtype_name(alias, canonical, tiny0_dir, monkeypatch):
    _reach(monkeypatch, "harness.parity.check.run_parity_check", lambda ckpt, ckpt_dir, settings, **kw: settings)
    settings = _run_command(["check", "--checkpoint", tiny0_dir, "--dtype", alias, "--tp", 1, "--kv-len", 320,
                             "--buckets", "256,16"])
    assert settings == RunSettings(tp=1, dtype=canonical, buckets=(16, 256), kv_len=320)


@pytest.mark.parametrize("alias, canonical", ALIASES)
def test_bisect_takes_every_dtype_name(alias, canonical, tiny0_dir, golden_dir, monkeypatch):
    _reach(monkeypatch, "harness.parity.bisect.bisect_golden", lambda ckpt, golden, settings, **kw: (settings, kw["mode"]))
    settings, mode = _run_command(["bisect", "--checkpoint", tiny0_dir, "--golden", golden_dir, "--dtype", alias,
                                   "--mode", "truncate"])
    assert settings == RunSettings(dtype=canonical) and mode == "truncate"


@pytest.mark.parametrize("alias, canonical", ALIASES)
def test_bench_takes_every_dtype_name(alias, canonical, tiny0_dir, tmp_path, monkeypatch):
    _reach(monkeypatch, "harness.cli.perf.run_bench", lambda ckpt, settings, **kw: settings)
    settings = _run_command(["bench", "--checkpoint", tiny0_dir, "--dtype", alias, "--out", tmp_path / "b.json"])
    assert settings == RunSettings(dtype=canonical, buckets=(64,))  # bench's default: the published bucket
    assert settings.short_dtype == {"bfloat16": "bf16", "float32": "fp32"}[canonical]  # what its result records


@pytest.mark.parametrize("alias, canonical", ALIASES)
def test_graphs_takes_every_dtype_name(alias, canonical, monkeypatch):
    _reach(monkeypatch, "harness.hlo.stats.model_graph_stats", lambda spec, settings, **kw: settings)
    settings = _run_command(["graphs", "--config", TINY_CONFIG, "--dtype", alias])
    assert (settings.dtype, settings.torch_dtype, settings.buckets) == (canonical, torch_dtype(canonical), (64,))


@pytest.mark.parametrize("alias, canonical", ALIASES)
def test_info_takes_every_dtype_name_and_sizes_by_it(alias, canonical, tmp_path, capsys):
    out = tmp_path / "info.json"
    # tp=4: the 12B in fp32 (48 GB) does not fit two NeuronCores, and info refuses a plan that does not fit
    assert main(["info", "--config", str(CONFIG_12B), "--tp", "4", "--dtype", alias, "--json", str(out)]) == 0
    low, high = (11.7e9, 12.3e9) if canonical == "float32" else (5.8e9, 6.2e9)  # 4 or 2 bytes a value
    assert low < json.loads(out.read_text())["bytes_per_rank"] < high


@pytest.mark.parametrize("command", [
    ["check", "--model", "tiny"], ["bisect", "--model", "tiny", "--golden", "nowhere"],
    ["bench", "--model", "tiny", "--out", "b.json"], ["graphs", "--config", TINY_CONFIG],
    ["info", "--config", TINY_CONFIG]], ids=lambda argv: argv[0])
def test_every_command_refuses_a_dtype_outside_the_vocabulary(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*map(str, command), "--dtype", "int8"])
    assert exit_info.value.code == EXIT_BAD_INPUT
    assert "--dtype 'int8': unknown dtype; use one of bf16, bfloat16, float32, fp32" in capsys.readouterr().err


def test_a_misspelt_backend_option_is_refused_before_model_work(tmp_path, capsys, monkeypatch):
    """Exit 2 naming the option, before the checkpoint is even opened."""
    from harness.cli import validate

    monkeypatch.setattr(validate, "open_checkpoint", lambda args: pytest.fail("the checkpoint was opened"))
    code = main(["check", "--model", "tiny", "--backend", "neuron", "--backend-option", "compile_worker=4"])
    assert code == EXIT_BAD_INPUT
    assert "--backend-option compile_worker: the neuron backend has no such option" in capsys.readouterr().err
