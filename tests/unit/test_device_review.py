"""The device review's defects (issue 36), each pinned by a test that failed on the code reviewed:
the compile-cache key covers the import closure of the graph code; ..."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
