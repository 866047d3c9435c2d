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
