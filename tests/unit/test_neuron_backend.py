"""The Neuron backend's pure-Python parts, on CPU: the version guard, the compiled-artifact cache
key and its atomic entries, NeuronCore assignment per pytest-xdist worker, weight assembly, the
traced module (same numbers as RankDecoder, only NxD-legal parameters), the NxD layer factory
(against stand-ins with NxD's real keyword names), and that nothing imports the Neuron SDK on CPU."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import tomllib
import torch
from torch import nn

from harness.backends import neuron, neuron_cache, neuron_env
from harness.base.errors import HarnessInputError
from harness.base.settings import RunSettings
from harness.inputs.spec import load_spec
from harness.inputs.tiny import TINY_CONFIG
from harness.port.model import RankDecoder, RankLinears
from harness.port.sharding import plan_model
from tests.sdk_free import import_without_sdks

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_spec():
    return load_spec(TINY_CONFIG)


def pyproject_pins() -> dict[str, str]:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["neuron"]
    return dict(req.split("==", 1) for req in extra)


def installed_like(pins: dict[str, str]) -> dict[str, str]:
    """Versions as an installed SDK reports them: a wildcard pin becomes a concrete local build."""
    return {name: pin.replace(".*", ".0+g1a2b3c") for name, pin in pins.items()}


# ---- importing on CPU ---------------------------------------------------------------------------

def test_import_needs_no_neuron_sdk(monkeypatch):
    """The module executes with every SDK import made to fail: its SDK imports are all lazy."""
    module = import_without_sdks(monkeypatch, neuron.__file__, "neuron_fresh_copy")
    assert callable(module.NeuronBackend) and callable(module.check_neuron_packages)
    with pytest.raises(ImportError):
        import torch_neuronx  # noqa: F401  (the poisoning is real)


def test_backend_refuses_missing_sdk_with_the_fix(monkeypatch):
    monkeypatch.setattr(neuron, "installed_neuron_packages", lambda: ({}, {}))
    with pytest.raises(HarnessInputError) as info:
        neuron.NeuronBackend(object(), RunSettings(backend="neuron"))
    message = str(info.value)
    for name in pyproject_pins():
        assert f"{name} is not installed" in message
    assert "--extra-index-url=https://pip.repos.neuron.amazonaws.com" in message and "[neuron]" in message


@pytest.mark.skipif(importlib.util.find_spec("torch_neuronx") is not None,
                    reason="a Neuron SDK is installed here: the unpatched guard may pass")
def test_backend_on_this_machine_raises_the_guard_error_not_importerror():
    with pytest.raises(HarnessInputError, match="pip install --extra-index-url"):
        neuron.NeuronBackend(object(), RunSettings(backend="neuron"))


@pytest.mark.skipif(importlib.util.find_spec("torch_neuronx") is not None,
                    reason="a Neuron SDK is installed here: the unpatched guard may pass")
def test_check_backend_neuron_on_this_machine_exits_2_with_the_install_command(capsys):
    """Without the SDK (the test double is not importable outside its tests) the command refuses."""
    from harness.cli import main

    assert importlib.util.find_spec("neuronx_distributed") is None
    assert main(["check", "--backend", "neuron", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "pip install --extra-index-url=https://pip.repos.neuron.amazonaws.com '.[neuron]'" in err
    assert all(f"{name} is not installed" in err for name in neuron.PINNED_VERSIONS)


# ---- the version guard --------------------------------------------------------------------------

def test_pins_match_pyproject_neuron_extra():
    assert neuron.PINNED_VERSIONS == pyproject_pins()
    assert neuron.PINNED_VERSIONS["libneuronxla"].startswith("2.2.")  # the PyTorch/XLA line, not JAX's 3.x


def test_toolchain_version_names_every_pinned_package():
    versions = installed_like(pyproject_pins())
    text = neuron.toolchain_version(versions)
    assert all(f"{n}={v}" in text for n, v in versions.items())
    other = neuron.toolchain_version({**versions, "libneuronxla": "3.0.3854.0"})
    assert neuron.artifact_cache_key(**{**BASE_KEY, "compiler_version": text}) != \
        neuron.artifact_cache_key(**{**BASE_KEY, "compiler_version": other})


def test_guard_accepts_the_pinned_versions_without_warning():
    versions = installed_like(pyproject_pins())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert neuron.check_neuron_packages(versions, {n: "real package" for n in versions}) == versions


@pytest.mark.parametrize("name,version", [("torch-neuronx", "1.0"), ("torch-neuronx", "1.0.0"),
                                          ("neuronx-distributed", "0.1"), ("neuronx-distributed", "0.1.0"),
                                          ("neuronx-cc", "1.0.post1"), ("neuronx-cc", "1.0"),
                                          ("libneuronxla", "1.0")])
def test_guard_refuses_each_pypi_placeholder(name, version):
    versions = installed_like(pyproject_pins())
    versions[name] = version
    with pytest.raises(HarnessInputError) as info:
        neuron.check_neuron_packages(versions, {})
    message = str(info.value)
    assert f"{name} {version}" in message and "placeholder" in message
    assert f"pip uninstall -y {name}" in message
    assert "pip install --extra-index-url=https://pip.repos.neuron.amazonaws.com '.[neuron]'" in message
    others = [n for n in versions if n != name]
    assert not any(f"{n} {versions[n]}" in message for n in others)  # only the culprit is named


PLACEHOLDER_DISTS = Path(__file__).resolve().parent / "placeholder_dists"  # METADATA of the real PyPI wheels
DOUBLE_DISTS = REPO / "tests" / "nxd_double" / "sdk"  # METADATA of the pinned versions (the double's)


def _site_with(tmp_path, placeholder: str, version_override: str | None = None) -> Path:
    """A site directory holding the pinned packages' metadata, with `placeholder`'s replaced by the
    real PyPI placeholder's METADATA (its version optionally rewritten)."""
    import shutil

    site = tmp_path / "site"
    dist_name = placeholder.replace("-", "_")
    for d in DOUBLE_DISTS.glob("*.dist-info"):
        if not d.name.startswith(dist_name + "-"):
            shutil.copytree(d, site / d.name)
    (src,) = PLACEHOLDER_DISTS.glob(f"{dist_name}-*.dist-info")
    text = (src / "METADATA").read_text()
    if version_override:
        text = re.sub(r"(?m)^Version: .*$", f"Version: {version_override}", text)
    (site / src.name).mkdir(parents=True)
    (site / src.name / "METADATA").write_text(text)
    return site


@pytest.mark.parametrize("name", ["torch-neuronx", "neuronx-distributed", "neuronx-cc", "libneuronxla"])
@pytest.mark.parametrize("override", [None, "9.9.9"], ids=["as-published", "version-rewritten"])
def test_guard_refuses_each_real_pypi_placeholder_from_its_metadata(tmp_path, monkeypatch, name, override):
    """Metadata as the real PyPI wheels ship it (tests/unit/placeholder_dists). With the version
    rewritten, only the "WRONG PACKAGE" text in the description body identifies the placeholder."""
    monkeypatch.syspath_prepend(str(_site_with(tmp_path, name, override)))
    versions, texts = neuron.installed_neuron_packages()
    assert set(versions) == set(neuron.PINNED_VERSIONS)
    assert "WRONG PACKAGE" in texts[name] and "WRONG PACKAGE" not in "".join(t for n, t in texts.items() if n != name)
    with pytest.raises(HarnessInputError) as info:
        neuron.check_neuron_packages()
    message = str(info.value)
    assert f"{name} {versions[name]} is the empty PyPI placeholder" in message
    assert f"pip uninstall -y {name} && pip install --extra-index-url" in message
    others = [n for n in versions if n != name]
    assert not any(f"{n} {versions[n]}" in message for n in others)


def test_guard_accepts_the_pinned_metadata_of_the_double(monkeypatch):
    monkeypatch.syspath_prepend(str(DOUBLE_DISTS))
    versions = neuron.check_neuron_packages()
    assert set(versions) == set(neuron.PINNED_VERSIONS)
    assert all(neuron.version_matches(versions[n], p) for n, p in neuron.PINNED_VERSIONS.items())


def test_guard_refuses_a_placeholder_by_its_metadata_summary():
    versions = installed_like(pyproject_pins())
    with pytest.raises(HarnessInputError, match="neuronx-distributed .*placeholder"):
        neuron.check_neuron_packages(versions, {"neuronx-distributed": "WRONG PACKAGE, see the Neuron docs"})


@pytest.mark.parametrize("version", ["2.27.5334", "2.27.5334.0+d4e5f6"])
def test_guard_refuses_neuronx_cc_2_27_5334(version):
    versions = installed_like(pyproject_pins())
    versions["neuronx-cc"] = version
    with pytest.raises(HarnessInputError) as info:
        neuron.check_neuron_packages(versions, {})
    assert f"neuronx-cc {version}" in str(info.value) and "NCC_ISMP902" in str(info.value)
    assert "pip install --extra-index-url" in str(info.value)


@pytest.mark.parametrize("missing", sorted(pyproject_pins()))
def test_guard_refuses_a_missing_package(missing):
    versions = installed_like(pyproject_pins())
    del versions[missing]
    with pytest.raises(HarnessInputError) as info:
        neuron.check_neuron_packages(versions, {})
    assert f"{missing} is not installed" in str(info.value)
    assert "pip install --extra-index-url" in str(info.value)


def test_guard_warns_but_runs_off_the_pins():
    versions = installed_like(pyproject_pins())
    versions["neuronx-cc"] = "2.25.3371.0+abc"  # SDK 2.30's compiler: not known broken, not validated
    with pytest.warns(UserWarning, match="neuronx-cc 2.25.3371"):
        neuron.check_neuron_packages(versions, {})


# ---- the artifact cache key ---------------------------------------------------------------------

BASE_KEY = dict(spec_hash="0123abcd", buckets=(16, 64), tp=2, compiler_version="neuronx-cc=2.26.6360.0",
                compiler_args=["--model-type=transformer", "-O1"], model_source_hash="f" * 64, capture=False,
                max_len=256, dtype=torch.bfloat16)
KEY_CHANGES = [("spec_hash", "0123abce"), ("buckets", (16, 128)), ("buckets", (64,)), ("tp", 1),
               ("compiler_version", "neuronx-cc=2.26.6361.0"), ("compiler_args", ["--model-type=transformer", "-O2"]),
               ("compiler_args", ["-O1", "--model-type=transformer"]), ("model_source_hash", "e" * 64),
               ("capture", True), ("max_len", 128), ("dtype", torch.float32)]


def test_cache_key_is_stable_and_a_plain_directory_name():
    key = neuron.artifact_cache_key(**BASE_KEY)
    assert key == neuron.artifact_cache_key(**dict(BASE_KEY))
    assert key == neuron.artifact_cache_key(**{**BASE_KEY, "buckets": (64, 16, 16)})  # same graphs
    assert key == neuron.artifact_cache_key(**{**BASE_KEY, "compiler_args": "--model-type=transformer -O1"})
    assert re.fullmatch(r"[A-Za-z0-9._-]+", key)


@pytest.mark.parametrize("field,value", KEY_CHANGES, ids=[f"{f}={v}" for f, v in KEY_CHANGES])
def test_cache_key_changes_with_each_component(field, value):
    assert neuron.artifact_cache_key(**{**BASE_KEY, field: value}) != neuron.artifact_cache_key(**BASE_KEY)


def test_model_source_hash_follows_the_source_text(monkeypatch):
    real = neuron.model_source_hash()
    assert real == neuron.model_source_hash()
    names = {p.name for p in neuron.MODEL_SOURCE_FILES}
    assert {"model.py", "sharding.py"} <= names
    assert {"spec.py", "graphs.py", "neuron.py"} <= names  # spec.py derives what the graph bakes in
    assert {"family.py", "blocks.py", "neuron_layers.py"} <= names  # the family's blocks, NxD's layers
    read = neuron_cache._read_source
    for changed in sorted(names):
        monkeypatch.setattr(neuron_cache, "_read_source",
                            lambda path, changed=changed: read(path) + ("\n# edit" if path.name == changed else ""))
        assert neuron.model_source_hash() != real, changed
    monkeypatch.setattr(neuron_cache, "_read_source", read)
    assert neuron.model_source_hash() == real


# ---- atomic cache entries -----------------------------------------------------------------------

def _write_all(tmp: Path, key: str = "k1"):
    for name in neuron.ENTRY_FILES:
        (tmp / name).write_bytes(b"x")
    (tmp / neuron.META_FILE).write_text(json.dumps({"format": neuron.CACHE_FORMAT, "key": key}))


def test_cache_entry_is_published_whole(tmp_path):
    entry = neuron.write_cache_entry(tmp_path, "k1", _write_all)
    assert entry == tmp_path / "k1" and neuron.cache_entry_complete(entry)
    assert neuron.read_cache_meta(entry, "k1")["key"] == "k1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1"]  # no temp dir left


@pytest.mark.parametrize("failure", ["raises", "incomplete"])
def test_failed_cache_write_leaves_nothing(tmp_path, failure):
    def write(tmp: Path):
        (tmp / neuron.MODEL_FILE).write_bytes(b"half")
        if failure == "raises":
            raise RuntimeError("compiler crashed")

    with pytest.raises((RuntimeError, neuron.NeuronBuildError)):
        neuron.write_cache_entry(tmp_path, "k1", write)
    assert list(tmp_path.iterdir()) == []


def test_cache_entry_published_first_by_another_worker_is_kept(tmp_path):
    neuron.write_cache_entry(tmp_path, "k1", _write_all)
    (tmp_path / "k1" / neuron.MODEL_FILE).write_bytes(b"first")
    neuron.write_cache_entry(tmp_path, "k1", _write_all)
    assert (tmp_path / "k1" / neuron.MODEL_FILE).read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1"]


def test_incomplete_or_foreign_entries_are_refused_with_the_fix(tmp_path):
    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / neuron.MODEL_FILE).write_bytes(b"x")
    with pytest.raises(HarnessInputError, match="incomplete.*Delete that directory"):
        neuron.read_cache_meta(tmp_path / "k1", "k1")
    neuron.write_cache_entry(tmp_path, "k2", lambda tmp: _write_all(tmp, key="other"))
    with pytest.raises(HarnessInputError, match="delete"):
        neuron.read_cache_meta(tmp_path / "k2", "k2")


# ---- NeuronCores per pytest-xdist worker ------------------------------------------------------------

@pytest.mark.parametrize("per_worker", [1, 2])
@pytest.mark.parametrize("index", [0, 1, 3])
def test_each_worker_gets_its_own_cores(index, per_worker):
    first = index * per_worker
    expected = str(first) if per_worker == 1 else f"{first}-{first + per_worker - 1}"
    assert neuron.visible_cores_for_worker(f"gw{index}", per_worker, total_cores=8) == expected


@pytest.mark.parametrize("worker", [None, "master"])
def test_without_xdist_the_cores_start_at_zero(worker):
    assert neuron.visible_cores_for_worker(worker, 2, total_cores=2) == "0-1"


def test_oversubscribed_workers_are_an_error():
    assert neuron.visible_cores_for_worker("gw1", 2, total_cores=4) == "2-3"
    with pytest.raises(HarnessInputError, match=r"gw2 needs NeuronCores 4-5 .* has 4.* -n 2"):
        neuron.visible_cores_for_worker("gw2", 2, total_cores=4)
    with pytest.raises(HarnessInputError, match="has 0"):
        neuron.visible_cores_for_worker(None, 2, total_cores=0)
    with pytest.raises(HarnessInputError, match="worker id"):
        neuron.visible_cores_for_worker("worker-1", 2, total_cores=4)


def test_assign_visible_cores_from_the_xdist_worker():
    env = {"PYTEST_XDIST_WORKER": "gw1", "NEURON_RT_VISIBLE_CORES": "0-1"}  # inherited from the parent
    assert neuron.assign_visible_cores(2, env, total_cores=4) == "2-3"
    assert env["NEURON_RT_VISIBLE_CORES"] == "2-3"
    own = {"NEURON_RT_VISIBLE_CORES": "6-7"}  # set by the user outside xdist: kept
    assert neuron.assign_visible_cores(2, own, total_cores=8) == "6-7"
    fresh: dict[str, str] = {}
    assert neuron.assign_visible_cores(2, fresh, total_cores=2) == "0-1" == fresh["NEURON_RT_VISIBLE_CORES"]
    with pytest.raises(HarnessInputError, match="no NeuronCore"):
        neuron.assign_visible_cores(2, {}, total_cores=0)


def test_core_count_from_devices_and_from_neuron_ls(monkeypatch):
    monkeypatch.setattr(neuron_env.shutil, "which", lambda name: None)
    monkeypatch.setattr(neuron_env, "_device_files", lambda: ["/dev/neuron0", "/dev/neuron1", "/dev/neuron2"])
    assert neuron.neuron_core_count() == 3 * neuron.INF2_CORES_PER_DEVICE
    listing = [{"neuron_device": 0, "nc_count": 2}, {"neuron_device": 1, "nc_count": 2},
               {"neuron_device": 2, "nc_count": 4}]
    monkeypatch.setattr(neuron_env.shutil, "which", lambda name: "/opt/aws/neuron/bin/neuron-ls")
    monkeypatch.setattr(neuron_env.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=json.dumps(listing)))
    assert neuron.neuron_core_count() == sum(d["nc_count"] for d in listing)

    def broken(*a, **k):
        raise neuron_env.subprocess.CalledProcessError(1, "neuron-ls")

    monkeypatch.setattr(neuron_env.subprocess, "run", broken)
    assert neuron.neuron_core_count() == 3 * neuron.INF2_CORES_PER_DEVICE


def test_no_neuron_cores_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(neuron_env.shutil, "which", lambda name: None)
    monkeypatch.setattr(neuron_env, "_device_files", lambda: [])
    assert neuron.neuron_core_count() == 0


# ---- graphs, routing, weights, outputs ------------------------------------------------------------

def test_graph_plan_one_prefill_per_bucket_and_decode():
    plan = neuron.graph_plan((64, 16, 16), max_len=128)
    assert sorted(plan.values()) == [1, 16, 64] and len(set(plan)) == 3
    for length in (1, 16, 64):
        assert plan[neuron.tag_for_length(length, plan)] == length
    with pytest.raises(HarnessInputError, match="no compiled graph takes 32"):
        neuron.tag_for_length(32, plan)
    assert sorted(neuron.graph_plan((1, 8), max_len=8).values()) == [1, 8]  # bucket 1 is the decode graph
    for bad in [(), (0, 16), (256,), ("x",)]:
        with pytest.raises(HarnessInputError):
            neuron.graph_plan(bad, max_len=128)


def test_example_inputs_have_the_traced_shapes_and_dtypes():
    x, pos = neuron.example_inputs(16, 64, torch.bfloat16)
    assert x.shape == (1, 16, 64) and x.dtype == torch.bfloat16
    assert pos.shape == (1, 16) and pos.dtype == neuron.POSITION_DTYPE and pos[0].tolist() == list(range(16))
    assert not pos.dtype.is_floating_point


def test_assemble_rank_weights_takes_exactly_what_the_graph_reads():
    states = [{"a.weight": torch.full((2, 3), float(r)), "n.weight": torch.ones(4), "unused": torch.zeros(1)}
              for r in range(2)]
    expected = {"a.weight": ((2, 3), torch.bfloat16), "n.weight": ((4,), torch.float32)}
    with pytest.raises(HarnessInputError, match=r"rank 0: checkpoint weights \['unused'\] are not read"):
        neuron.assemble_rank_weights(states, expected)  # a weight no graph reads is refused, not warned about
    for state in states:
        del state["unused"]
    out = neuron.assemble_rank_weights(states, expected)
    assert [sorted(d) for d in out] == [sorted(expected)] * 2
    for rank, d in enumerate(out):
        assert d["a.weight"].dtype == torch.bfloat16 and torch.equal(d["a.weight"].float(), states[rank]["a.weight"])
        assert d["n.weight"].dtype == torch.float32
    with pytest.raises(HarnessInputError, match=r"missing \['b.weight'\]"):
        neuron.assemble_rank_weights(states, {**expected, "b.weight": ((1,), torch.float32)})
    with pytest.raises(HarnessInputError, match=r"a.weight \(2, 3\) \(graph expects \(3, 2\)\)"):
        neuron.assemble_rank_weights(states, {"a.weight": ((3, 2), torch.bfloat16)})


def test_buffer_keys_are_the_raw_checkpoint_keys():
    """NxDModel keys states and weights by the metaneff's checkpoint_key as is (bytes decoded)."""
    for raw in ("layers.0.self_attn.cache.k", "layers->0.cache.k"):
        assert neuron._checkpoint_key(types.SimpleNamespace(checkpoint_key=raw.encode())) == raw
        assert neuron._checkpoint_key(types.SimpleNamespace(checkpoint_key=raw)) == raw


def test_unpack_outputs():
    logits, a, b, x = torch.randn(1, 4, 8), torch.randn(1, 4, 2), torch.randn(1, 4, 2), torch.randn(1, 4, 2)
    assert neuron.unpack_outputs(logits, None)[0] is logits
    got, caps = neuron.unpack_outputs((logits, a, b), ["x", "y"], inputs_embeds=x)
    assert got is logits and caps["x"] is a and caps["y"] is b and list(caps) == ["embeddings", "x", "y"]
    assert caps["embeddings"] is x  # taken on the host, not a graph output
    with pytest.raises(neuron.NeuronBuildError):
        neuron.unpack_outputs((logits, a), ["x", "y"], inputs_embeds=x)
    with pytest.raises(neuron.NeuronBuildError, match="host"):
        neuron.unpack_outputs((logits, a, b), ["x", "y"])


def test_normalize_compiler_args():
    assert neuron.normalize_compiler_args("--a=1  -O2 --target inf2") == ["--a=1", "-O2", "--target", "inf2"]
    for bad in ("-O1 --target=inf2", ["--target=trn1"]):
        with pytest.raises(HarnessInputError, match="two words"):
            neuron.normalize_compiler_args(bad)
    assert " ".join(neuron.DEFAULT_COMPILER_ARGS).endswith("--target inf2")
    assert neuron.DEFAULT_COMPILER_ARGS[0] == "--enable-saturate-infinity"
    assert neuron.normalize_compiler_args(("-O1",)) == ["-O1"]
    defaults = neuron.normalize_compiler_args(None)
    assert defaults == list(neuron.DEFAULT_COMPILER_ARGS) and defaults is not neuron.DEFAULT_COMPILER_ARGS


# ---- the traced module -----------------------------------------------------------------------------

def _nxd_accepts(fn) -> bool:
    """ModelBuilder's rule for a traced forward: every parameter is required or defaults to None."""
    params = [p for name, p in inspect.signature(fn).parameters.items() if name != "self"]
    return all(p.default is inspect.Parameter.empty or p.default is None for p in params) and not any(
        p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def test_traced_forward_is_legal_for_modelbuilder():
    assert _nxd_accepts(neuron.TracedDecoder.forward)
    assert not _nxd_accepts(RankDecoder.forward)  # why the wrapper exists: capture=False


@pytest.mark.parametrize("with_captures", [False, True])
def test_traced_decoder_computes_what_rankdecoder_computes(tiny_spec, with_captures):
    torch.manual_seed(0)
    ref = RankDecoder(tiny_spec, tp=1, max_len=32, dtype=torch.float32)
    for p in ref.parameters():
        nn.init.normal_(p, std=0.2)
    traced = neuron.TracedDecoder(tiny_spec, 1, 32, torch.float32, RankLinears(), with_captures=with_captures)
    traced.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, 8, tiny_spec.hidden_size)
    pos = torch.arange(8)[None]
    with torch.no_grad():
        want_logits, want_caps = ref(x, pos, capture=True)
        out = traced(x, pos.to(neuron.POSITION_DTYPE))  # the dtype the device graph takes
    logits, caps = neuron.unpack_outputs(out, traced.capture_names if with_captures else None, inputs_embeds=x)
    assert torch.equal(logits, want_logits)
    if with_captures:
        assert traced.capture_names == [n for n in want_caps if n != "embeddings"]  # no input as output
        assert len(out) == len(want_caps) and not any(t is x for t in out)
        assert list(caps) == list(want_caps)
        assert all(torch.equal(caps[name], want_caps[name]) for name in want_caps)
    else:
        assert isinstance(out, torch.Tensor) and caps == {}


def test_every_buffer_of_the_traced_module_is_a_checkpoint_weight_or_kv_cache(tiny_spec):
    """Rope frequencies are computed in the graph: no buffer whose value the device would have to
    be fed from the model code (by torch-neuronx's naming rules for constants)."""
    module = neuron.TracedDecoder(tiny_spec, 2, 32, torch.bfloat16, RankLinears())
    kv = neuron.kv_buffer_names(module)
    assert len(kv) == 2 * tiny_spec.num_layers and all(dict(module.named_buffers())[n].abs().sum() == 0 for n in kv)
    assert neuron.constant_buffers(module) == {}
    assert set(dict(module.named_buffers())) <= set(module.state_dict()) | set(kv)
    module.register_buffer("inv_freq_0", torch.ones(4), persistent=False)  # the old layout: refused by the backend
    assert list(neuron.constant_buffers(module)) == ["inv_freq_0"]


def test_replicated_kv_heads_use_the_replicated_factory(tiny_spec):
    """Attention asks for `replicated` exactly where KV heads cannot shard (nkv % tp != 0)."""
    calls = []

    class Recording(RankLinears):
        def column(self, i, o):
            calls.append(("column", i, o))
            return super().column(i, o)

        def replicated(self, i, o):
            calls.append(("replicated", i, o))
            return super().replicated(i, o)

    tp = 2
    module = RankDecoder(tiny_spec, tp=tp, max_len=16, dtype=torch.float32, linears=Recording())
    replicate_layers = [layer for layer in tiny_spec.layers if layer.kv_heads % tp]
    assert replicate_layers, "the tiny fixture must have a replicated-KV (full) layer"
    kv_projs = 1 + (0 if replicate_layers[0].k_eq_v else 1)
    assert [c for c in calls if c[0] == "replicated"] == [
        ("replicated", tiny_spec.hidden_size, layer.head_dim) for layer in replicate_layers for _ in range(kv_projs)]
    for layer in replicate_layers:
        k = module.layers[layer.index].self_attn.k_proj
        assert type(k) is nn.Linear and tuple(k.weight.shape) == (layer.head_dim, tiny_spec.hidden_size)


# ---- NeuronLinears against stand-ins with NxD's keyword names -------------------------------------

class _FakeColumnParallelLinear(nn.Module):
    # parameter names as in neuronx_distributed.parallel_layers.layers.ColumnParallelLinear
    def __init__(self, input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, device=None,
                 stride=1, init_method=None, sequence_parallel_enabled=False, sequence_dimension=None,
                 keep_master_weight=False, skip_bias_add=False, pad=False, pad_alignment_size_per_rank=1,
                 keep_padded_output=False, tensor_model_parallel_group=None, reduce_dtype=torch.float32,
                 rank_ordering=None):
        super().__init__()
        self.kwargs = dict(input_size=input_size, output_size=output_size, bias=bias, gather_output=gather_output,
                           dtype=dtype, reduce_dtype=reduce_dtype)
        self.weight = nn.Parameter(torch.empty(output_size // _FAKE_TP, input_size, dtype=dtype))


class _FakeRowParallelLinear(nn.Module):
    # parameter names as in neuronx_distributed.parallel_layers.layers.RowParallelLinear
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32,
                 device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
                 sequence_dimension=None, keep_master_weight=False, skip_bias_add=False, pad=False,
                 reduce_output=True, tensor_model_parallel_group=None, reduce_dtype=torch.float32,
                 tile_cc=False, rank_ordering=None):
        super().__init__()
        self.kwargs = dict(input_size=input_size, output_size=output_size, bias=bias,
                           input_is_parallel=input_is_parallel, dtype=dtype, reduce_dtype=reduce_dtype)
        self.weight = nn.Parameter(torch.empty(output_size, input_size // _FAKE_TP, dtype=dtype))


_FAKE_TP = 2


@pytest.fixture
def fake_nxd(monkeypatch):
    layers = types.ModuleType("neuronx_distributed.parallel_layers.layers")
    layers.ColumnParallelLinear, layers.RowParallelLinear = _FakeColumnParallelLinear, _FakeRowParallelLinear
    monkeypatch.setitem(sys.modules, "neuronx_distributed", types.ModuleType("neuronx_distributed"))
    monkeypatch.setitem(sys.modules, "neuronx_distributed.parallel_layers",
                        types.ModuleType("neuronx_distributed.parallel_layers"))
    monkeypatch.setitem(sys.modules, "neuronx_distributed.parallel_layers.layers", layers)


def test_neuron_linears_build_the_per_rank_shapes_of_the_shards(tiny_spec, fake_nxd):
    tp, dtype = _FAKE_TP, torch.bfloat16
    module = neuron.TracedDecoder(tiny_spec, tp, 32, dtype, neuron.NeuronLinears(tp, dtype))
    cpu = RankDecoder(tiny_spec, tp=tp, max_len=32, dtype=dtype)  # its shapes are the shards' (strict load)
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == \
           {k: tuple(v.shape) for k, v in cpu.state_dict().items()}
    plans = plan_model(tiny_spec, tp)
    h = tiny_spec.hidden_size
    for layer, plan in zip(module.layers, plans):
        attn, d = layer.self_attn, plan.head_dim
        assert attn.q_proj.kwargs == dict(input_size=h, output_size=plan.q_heads * d, bias=False,
                                          gather_output=False, dtype=dtype, reduce_dtype=torch.float32)
        assert attn.o_proj.kwargs == dict(input_size=plan.q_heads * d, output_size=h, bias=False,
                                          input_is_parallel=True, dtype=dtype, reduce_dtype=torch.float32)
        if plan.kv_heads % tp:
            assert type(attn.k_proj) is nn.Linear and attn.k_proj.weight.dtype == dtype
        else:
            assert attn.k_proj.kwargs["output_size"] == plan.kv_heads * d
            assert attn.k_proj.kwargs["gather_output"] is False
        assert layer.mlp.down_proj.kwargs["input_size"] == tiny_spec.intermediate_size
    assert module.lm_head.kwargs == dict(input_size=h, output_size=tiny_spec.vocab_size, bias=False,
                                         gather_output=True, dtype=dtype, reduce_dtype=torch.float32)


# ---- the CI workflow's compile-cache key -------------------------------------------------------
WORKFLOW = Path(neuron_cache.__file__).resolve().parents[2] / ".github" / "workflows" / "inf2.yml"


def test_ci_cache_key_covers_every_input_of_the_artifact_key(tmp_path):
    """The one list: every file hashed into the artifact key (MODEL_SOURCE_FILES), the module that
    holds CACHE_FORMAT and the key, and the toolchain pins; the hash follows each file's bytes."""
    files = neuron_cache.ARTIFACT_KEY_FILES
    assert set(neuron.MODEL_SOURCE_FILES) <= set(files)
    assert {"neuron_cache.py", "neuron_packages.py", "pyproject.toml"} <= {p.name for p in files}
    assert all(p.is_file() for p in files)
    real = neuron_cache.ci_cache_key()
    root = Path(neuron_cache.__file__).resolve().parents[2]
    for path in files:  # a copy of the tree with one file edited gives another key
        copies = []
        for other in files:
            target = tmp_path / other.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(other.read_bytes() + (b"\n# edit" if other == path else b""))
            copies.append(target)
        monkey_root = neuron_cache._HARNESS_DIR
        try:
            neuron_cache._HARNESS_DIR = tmp_path / "harness"
            assert neuron_cache.ci_cache_key(copies) != real, path.name
        finally:
            neuron_cache._HARNESS_DIR = monkey_root


def test_ci_workflow_keys_its_compile_cache_on_that_list():
    """inf2.yml's cache key is the module's hash (no hand-kept hashFiles list to fall behind), its
    step runs after the venv exists, and the venv is made with python3.12."""
    text = WORKFLOW.read_text()
    assert "python -m harness.backends.neuron_cache" in text
    restore = text.split("name: Restore the compile cache", 1)[1].split("- name:", 1)[0]
    assert "steps.compile-key.outputs.hash" in restore and "hashFiles" not in restore
    assert text.index("id: compile-key") > text.index("name: Set up the virtual environment")
    assert re.search(r"^\s*PYTHON: python3\.12\s*$", text, re.M)
