"""The device review's defects (issue 36), each pinned by a test that failed on the code reviewed:
the compile-cache key covers the import closure of the graph code; ..."""

from __future__ import annotations

import re

import subprocess
import sys
from pathlib import Path

import pytest

from harness.backends import neuron_cache

ROOT = Path(neuron_cache.__file__).resolve().parents[2]


def test_the_cache_key_covers_every_harness_module_the_graph_code_imports():
    """Python's own import of the graph code (port/graphs.py, backends/neuron_layers.py), not the
    key's walk of it: every harness module it loads outside harness/base is hashed into the key
    (kv_slots.py and device_plan.py were not), and an edit to any of them changes the key."""
    # harness/backends/__init__.py (the Backend protocol, the engine) bare: a package's own imports
    # are not the graph code's
    code = ("import sys, types, harness; pkg = types.ModuleType('harness.backends'); "
            "pkg.__path__ = [harness.__path__[0] + '/backends']; sys.modules['harness.backends'] = pkg; "
            "import harness.port.graphs, harness.backends.neuron_layers; "
            "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.startswith('harness.') "
            "and not n.startswith('harness.base') and getattr(m, '__file__', None)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    loaded = {Path(line).resolve() for line in out.split() if not line.endswith("__init__.py")}
    assert {"graphs.py", "model.py", "kv_slots.py"} <= {p.name for p in loaded}
    hashed = set(neuron_cache.MODEL_SOURCE_FILES)
    assert loaded <= hashed, sorted(str(p.relative_to(ROOT)) for p in loaded - hashed)
    assert {"kv_slots.py", "device_plan.py"} <= {p.name for p in hashed}
    real = neuron_cache.model_source_hash()
    read = neuron_cache._read_source
    for path in sorted(hashed):
        neuron_cache._read_source = lambda p, path=path: read(p) + ("\n# edit" if p == path else "")
        try:
            assert neuron_cache.model_source_hash() != real, path
        finally:
            neuron_cache._read_source = read
    assert set(neuron_cache.DRAFTER_SOURCE_FILES).isdisjoint(hashed)  # a target-only key ignores the drafter


def test_every_graph_but_context_encoding_compiles_with_the_decode_flags_at_O2():
    """As NxD Inference: prefill buckets at the build's flags (-O1), decode, the speculative verify
    graph and the draft graphs at the decode flags, -O2 by default (verify took the prefill flags,
    and decode -O1)."""
    from harness.backends.neuron import kv_tags
    from harness.backends.neuron_drafter import draft_tags

    base = neuron_cache.normalize_compiler_args(None)
    decode = neuron_cache.decode_flags(base, None)
    assert "-O2" in decode and "-O1" not in decode and decode[:2] == base[:2] and "--target" in decode
    tags = {**kv_tags((16, 64), 64, speculate=3), **draft_tags((16, 64))}
    flags = neuron_cache.per_graph_flags(tags, base, decode)
    assert set(flags) == set(tags)
    kinds = {tag: ("-O2" if "-O2" in f.split() else "-O1") for tag, f in flags.items()}
    assert {t for t, k in kinds.items() if k == "-O1"} == {t for t in tags if t.startswith("prefill_")}
    assert any(t.startswith("verify_4") for t in tags) and any(t.startswith("draft_kv") for t in tags)
    own = neuron_cache.decode_flags(base, "-O3 --target inf2")  # given: taken as they are
    assert neuron_cache.per_graph_flags(["verify_4_kv16"], base, own) == {"verify_4_kv16": "-O3 --target inf2"}


def test_token_ordering_enters_the_draft_graph_as_int32():
    """The project's rule for indices at the device boundary (graphs.POSITION_DTYPE): int32 in,
    widened inside the graph; token_ordering was an int64 weight. The draft step still scores the
    same tokens."""
    import torch

    import json

    from harness import FIXTURES_DIR
    from harness.inputs.assistant_spec import assistant_spec_from_dict
    from harness.inputs.spec import load_spec
    from harness.port.drafter import RankDrafter
    from harness.port.model import RankLinears
    from tests.unit.test_draft_graphs import PAIRS

    target, config = PAIRS["12b"]
    aspec = assistant_spec_from_dict(json.loads((FIXTURES_DIR / "configs" / "tiny" / config).read_text()),
                                     load_spec(target))
    assert aspec.ordered
    head = RankDrafter(aspec, 1, RankLinears(), torch.bfloat16).masked_embedding.float()
    assert head.token_ordering.dtype == torch.int32
    x = torch.randn(1, 1, aspec.hidden_size)
    weight = torch.randn(aspec.vocab_size, aspec.hidden_size)
    logits, clusters = head(x, weight)
    order = head.token_ordering.long().view(-1, head.per_centroid)
    ids = order.index_select(0, clusters.reshape(-1)).reshape(-1)
    assert torch.equal(logits[0, 0, ids], (x @ weight[ids].T)[0, 0])


def test_a_draft_step_reads_the_targets_kv_before_carrying_it():
    """carry_kv reassigns every KV buffer (the draft graph's state); the target KV the drafter reads
    must be the input cache, not the carried copy (a read after the write orders the graph's reads
    behind a rewrite of every buffer)."""
    import torch

    from tests.unit.test_draft_graphs import fused

    module, spec, aspec = fused("12b", capture=False)
    inputs = {n: m.k for n, m in module.named_modules() if hasattr(m, "last_read")}
    read_from = []
    original = type(module).target_kv

    def spy(self, layer):
        cache = self.get_submodule(f"layers.{layer}.self_attn.cache")
        read_from.append(cache.k is inputs[f"layers.{layer}.self_attn.cache"])
        return original(self, layer)

    type(module).target_kv = spy
    try:
        module(draft_embeds=torch.zeros(1, 1, spec.hidden_size), draft_hidden=torch.zeros(1, 1, spec.hidden_size),
               draft_position=torch.tensor([[3]], dtype=torch.int32))
    finally:
        type(module).target_kv = original
    assert read_from and all(read_from), read_from
    assert all(m.k is not inputs[n] for n, m in module.named_modules() if n in inputs)  # and still carried


def test_a_traced_module_keeps_no_tensor_of_its_call():
    """After a forward of the traced family decoder (per-layer inputs, KV-shared layers reading
    their source's last read) and of a batched one, no module holds a tensor outside its parameters
    and buffers (last_read and _per_layer_inputs did: a traced tensor kept past its trace)."""
    import torch

    from harness.inputs.spec import load_spec
    from harness.inputs.tiny import TINY_FAMILY
    from harness.port.graphs import batch_example_inputs, example_inputs, input_width, traced_class
    from harness.port.model import RankLinears

    spec = load_spec(TINY_FAMILY["e2b"])
    assert spec.per_layer_input_size and any(layer.kv_source is not None for layer in spec.layers)
    for batched, inputs in ((False, example_inputs(8, input_width(spec), torch.float32, last_row=True)),
                            (True, batch_example_inputs(8, input_width(spec), torch.float32, 2, last_row=True))):
        module = traced_class(spec, batched=batched)(spec, 1, 16, torch.float32, RankLinears(), last_row_only=True,
                                                     slots=2 if batched else 1).eval()
        with torch.no_grad():
            module(*inputs)
        kept = [f"{name}.{attr}" for name, sub in module.named_modules() for attr, value in vars(sub).items()
                if not attr.startswith("_") or attr == "_per_layer_inputs"
                if isinstance(value, torch.Tensor) or (isinstance(value, tuple) and any(isinstance(v, torch.Tensor)
                                                                                        for v in value))]
        assert kept == [], (batched, kept[:4])


def test_every_backends_forward_refuses_seq_ids_outside_its_slots(tiny0_ckpt):
    """seq_ids are checked in forward on every backend (cpu here; the compiled backends through
    graphs.batch_graph_inputs, whose check is the same call_seq_ids): an out-of-range, repeated or
    miscounted slot is a clear input error naming the slots, before any model work (the device
    clamps or drops an out-of-range index without a word; cpu raised an IndexError from a rank
    thread)."""
    import pytest
    import torch

    from harness.backends import build_engine
    from harness.base.errors import HarnessInputError
    from harness.base.settings import RunSettings
    from harness.port.graphs import batch_graph_inputs, graph_plan

    backend = build_engine(tiny0_ckpt, RunSettings(backend="cpu", tp=1, batch=2, buckets=(16,), kv_len=16)).backend
    embeds, positions = torch.zeros(2, 1, backend.spec.hidden_size, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.long)
    for bad, says in (([0, 2], r"\[0, 2\]: a slot outside \[0, 2\)"), ([1, 1], "named twice"),
                      ([-1, 0], "a slot outside"), ([0], "1 slots named for 2 rows")):
        with pytest.raises(HarnessInputError, match=says):
            backend.forward(embeds, positions, seq_ids=torch.tensor(bad))
        with pytest.raises(HarnessInputError, match=says):
            batch_graph_inputs(backend.spec, graph_plan((16,), 16), embeds, positions, torch.tensor(bad),
                               torch.bfloat16, slots=2)
    with pytest.raises(HarnessInputError, match="3 rows in one call"):
        backend.forward(torch.zeros(3, 1, backend.spec.hidden_size), torch.zeros(3, 1, dtype=torch.long),
                        seq_ids=torch.tensor([0, 1, 0]))
    logits, _ = backend.forward(embeds, positions, seq_ids=torch.tensor([1, 0]))
    assert logits.shape[0] == 2


def test_graphs_by_stage_are_the_graphs_the_neuron_backend_traces():
    """info --plan's graphs per build for the 12B at TP 2 are the ModelBuilder tags the neuron backend
    traces for the same options (neuron.kv_tags: every (length, KV bucket) at each batch bucket,
    verify graphs; neuron_drafter.draft_tags), for every command and option set."""
    from harness import FIXTURES_DIR
    from harness.backends.neuron import kv_tags
    from harness.backends.neuron_drafter import draft_tags
    from harness.inputs.spec import load_spec
    from harness.plan.compile_budget import BATCH_STAGE_SLOTS
    from harness.plan.host_plan import resource_plan
    from harness.port.graphs import kv_buckets

    spec = load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")
    buckets, kv = (64, 256), 4096
    one, slots4 = len(kv_tags(buckets, kv)), len(kv_tags(buckets, kv, slots=BATCH_STAGE_SLOTS))
    plan = resource_plan(spec, 2, "bfloat16", kv, buckets, batch=None)["commands"]  # a check with its batch stage
    assert plan["check"]["graphs_by_stage"] == {"parity build": one, "batch stage": slots4, "served build": one}
    assert plan["bench"]["graphs_by_stage"] == {"perf build": one} and plan["reference"]["graphs"] == 0
    batched = resource_plan(spec, 2, "bfloat16", kv, buckets, batch=2, options={"served": False})["commands"]
    assert batched["check"]["graphs_by_stage"] == {"parity build": len(kv_tags(buckets, kv, slots=2))}
    spec3 = resource_plan(spec, 2, "bfloat16", kv, buckets, batch=1, speculate=3)["commands"]
    assert spec3["bisect"]["graphs"] == len(kv_tags(buckets, kv, speculate=3))
    # speculation in a batch: every graph (verify too) at each batch bucket, each draft graph once
    from harness.plan.compile_budget import graphs_by_stage

    drafts = len(draft_tags(kv_buckets(buckets, kv)))
    assert graphs_by_stage("check", buckets, kv, batch=4, speculate=3, drafts=True) == {
        "parity build": len(kv_tags(buckets, kv, slots=4, speculate=3)) + drafts,
        "served build": len(kv_tags(buckets, kv, slots=4, speculate=3)) + drafts}
    budget = plan["check"]["compile"]
    # each build compiles on a pool of `workers` (compile_budget: ceil(graphs / workers) rounds a build)
    rounds = sum(-(-n // budget["workers"]) for n in plan["check"]["graphs_by_stage"].values())
    assert budget["minutes"] == rounds * budget["per_graph"] and "published" in budget["source"]
    assert len(draft_tags(kv_buckets(buckets, kv))) == len(kv_buckets(buckets, kv))


@pytest.mark.slow  # two check validations (~4 s); cheap sibling: test_graphs_by_stage_are_the_graphs_the_neuron_backend_traces
def test_a_device_run_over_its_compile_budget_is_refused_before_compiling(capsys, tmp_path, monkeypatch):
    """--compile-budget MINUTES: a neuron check planned over it exits 2 before any build, naming
    each build's graphs (the default device check: parity and served builds, the batch stage only
    with --batch N); the same run within it goes on (to the SDK check on this host)."""
    from harness.cli import main

    monkeypatch.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "cache"))
    # the limit: what the parity build alone takes (its rounds on the planned compile pool), so the
    # default check (a served build too) is over it and --skip-served-build is within it
    main(["check", "--model", "tiny", "--backend", "neuron", "--skip-served-build", "--compile-budget", "0.001"])
    alone = re.search(r"takes about (\d+) min", capsys.readouterr().err)
    assert alone, "a check over --compile-budget 0.001 names its minutes"
    limit = alone.group(1)
    assert main(["check", "--model", "tiny", "--backend", "neuron", "--compile-budget", limit]) == 2
    err = capsys.readouterr().err
    assert "14 graphs (parity build 7, served build 7)" in err and f"--compile-budget {limit}" in err
    assert not (tmp_path / "cache").exists()
    assert main(["check", "--model", "tiny", "--backend", "neuron", "--compile-budget", limit,
                 "--skip-served-build"]) == 2
    assert "compile-budget" not in capsys.readouterr().err  # within budget: refused later, by the SDK check


def test_info_batch_and_the_memory_plan_give_one_answer():
    """`info --batch 1,2,4,8 --kv-len 4096` refuses by the same device fit the memory plan prints its
    most sequences by (they said 7 and 4): one max_batch, the perf build's weights, KV slots and
    every batch bucket's graphs; the fit at that batch fits and one more does not."""
    import pytest

    from harness import FIXTURES_DIR
    from harness.base.errors import HarnessInputError
    from harness.inputs.spec import load_spec
    from harness.plan.batch_fit import batch_fit, refuse_unfit_batch
    from harness.plan.memory import instance_memory_plan, render_memory_plan

    spec = load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")
    plan = instance_memory_plan(spec, 2, "bfloat16", 4096)
    most = plan["max_batch"]
    assert f"at most {most} sequences" in render_memory_plan(plan, "linear")
    assert batch_fit(spec, 2, "bfloat16", most, 4096)["fits"] and not batch_fit(spec, 2, "bfloat16", most + 1, 4096)["fits"]
    with pytest.raises(HarnessInputError, match=rf"--batch 8 at --kv-len 4096: .* at most {most} sequences"):
        refuse_unfit_batch(batch_fit(spec, 2, "bfloat16", 8, 4096))
    assert 1 <= most < 7


def test_info_batch_on_the_command_line_and_its_memory_plan_say_the_same_most(capsys):
    """The command itself: `info --batch 1,2,4,8 --kv-len 4096` refuses batch 8 naming the most
    sequences the memory plan prints, and with the batches that fit the memory plan's line and
    every row of the batch table name that same number (the served build's fit, counted once)."""
    import re

    from harness import FIXTURES_DIR
    from harness.cli import EXIT_BAD_INPUT, EXIT_OK, main

    args = ["info", "--config", str(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json"), "--tp", "2", "--kv-len", "4096"]
    assert main(args + ["--batch", "1,2,4,8"]) == EXIT_BAD_INPUT
    refused = re.search(r"at most (\d+) sequences fit", capsys.readouterr().err)
    assert main(args + ["--batch", "1,2"]) == EXIT_OK
    out = capsys.readouterr().out
    plan = re.search(r"batch at --kv-len 4096: at most (\d+) sequences", out)
    table = set(re.findall(r"^\s+4096\s+\d+ .*\(at most (\d+)\)$", out, re.M))
    assert refused and plan and table == {plan.group(1)} and refused.group(1) == plan.group(1), (refused, plan, table)
    assert 1 <= int(plan.group(1)) < 8


def test_a_device_check_whose_build_does_not_fit_a_core_is_refused_before_compiling(capsys, tmp_path, monkeypatch):
    """The check's preflight refuses by the same device fit as info and doctor (a core of 1 GiB here:
    the tiny model's builds are small), exit 2, nothing built; the cpu backend is not planned by it."""
    from harness.cli import main
    from harness.plan import instances

    monkeypatch.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(instances, "CORE_HBM", 1 << 20)
    assert main(["check", "--model", "tiny", "--backend", "neuron", "--skip-served-build"]) == 2
    err = capsys.readouterr().err
    assert "check: at tp=2 one NeuronCore needs" in err and "but has 0 GiB" in err, err
    assert not (tmp_path / "cache").exists()
