"""`gemma-parity reduce BUNDLE`: shrink a failing bundle's module while the oracle still fails
(docs/snapshot.md#reducing-a-bundle), as XLA's hlo_bisect does: keep one failing output (the one whose
graph is smallest), drop what it does not need, replace instructions by constants of their values in
the reference run (the module run once on XLA's CPU backend with every instruction an output), first
a cut across the whole graph found by bisection, then one instruction at a time until no single
replacement keeps it failing. The module and a test module (a planted stand-in) change in step.

The default oracle is the bundle's own compare (its run_hlo.py) on the platform at hand: on cpu the test
module's run against the reference value of the kept output, within its tolerance. `--oracle CMD`: CMD
runs with a candidate bundle's directory as its last argument; exit 1 means it still fails."""

from __future__ import annotations

import copy
import importlib.util
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from harness.base.atomic import atomic_directory
from harness.base.errors import HarnessInputError
from harness.bundle import hlo_text
from harness.bundle.runner import load_runner
from harness.bundle.write import CHECK_SH, readme


class Reduction:
    def __init__(self, bundle, oracle: str | None = None):
        self.bundle = Path(bundle)
        self.runner = load_runner(self.bundle)
        try:
            self.manifest = self.runner.load_bundle(self.bundle)
            self.inputs = self.runner.load_inputs(self.bundle, self.manifest)
            self.runner.cpu_client()
        except self.runner.Refused as exc:
            raise HarnessInputError(f"reduce {bundle}: {exc}") from None
        self.oracle, self.calls = oracle, 0
        self.platform = "neuron" if importlib.util.find_spec("libneuronxla") else "cpu"  # the platform at hand
        self.ref_text = (self.bundle / self.manifest["module"]["text"]).read_text()
        test = self.manifest.get("test_module")
        self.test_text = (self.bundle / test).read_text() if test else None
        self.tolerance = self.manifest["outputs"][0]["tolerance"]
        probe, names = hlo_text.all_values_text(hlo_text.parse(self.ref_text))
        self.values = dict(zip(names, self.runner.run_text(probe, self.inputs)))

    def modules(self):
        ref = hlo_text.parse(self.ref_text)
        return ref, hlo_text.parse(self.test_text) if self.test_text else None

    def run_test(self, ref, test, params):
        return self.runner.run_text(hlo_text.render(test or ref), [self.inputs[k] for k in params])

    def fails(self, ref, test, params) -> bool:
        """The oracle on a candidate (its root the one kept output)."""
        self.calls += 1
        if self.oracle is not None or self.platform == "neuron":
            with tempfile.TemporaryDirectory() as tmp:
                self.write(Path(tmp) / "candidate", ref, test, params, {})
                cand = str(Path(tmp) / "candidate")
                command = (["sh", "-c", f'{self.oracle} "$0"', cand] if self.oracle is not None else
                           [sys.executable, str(Path(cand) / "run_hlo.py"), cand, "neuron"])
                done = subprocess.run(command, capture_output=True, timeout=3600)
            return done.returncode == 1
        try:
            out = self.run_test(ref, test, params)[0]
        except Exception:  # a candidate XLA refuses is not a failure of the module
            return False
        rows = self.runner.compare([out], [self.values[ref.root]], {"outputs": [
            {"name": ref.root, "tolerance": self.tolerance}]})
        return not rows[0][1] <= rows[0][2]

    def rooted(self, name):
        ref, test = self.modules()
        for m in (ref, test):
            if m is not None:
                hlo_text.set_root(m, name)
        params = hlo_text.dce(ref)
        if test is not None and hlo_text.dce(test) != params:
            raise HarnessInputError("the test module's parameters are not the module's")
        return ref, test, params

    def replaced(self, ref, test, names):
        ref, test = copy.deepcopy(ref), copy.deepcopy(test)
        for m in (ref, test):
            if m is None:
                continue
            for name in names:
                hlo_text.to_constant(m, name, self.values[name])
        params = hlo_text.dce(ref)
        if test is not None:
            hlo_text.dce(test)
        return ref, test, params

    def first_failing(self, name: str) -> str:
        """The earliest instruction of `name`'s graph whose value on the test module breaks the
        tolerance (the default oracle: every instruction's value in one run), else `name`."""
        if self.oracle is not None or self.platform != "cpu":
            return name
        test = hlo_text.parse(self.test_text or self.ref_text)
        probe, names = hlo_text.all_values_text(test)
        moved = dict(zip(names, self.runner.run_text(probe, self.inputs)))
        cone = hlo_text.live(_rooted_copy(hlo_text.parse(self.ref_text), name))
        for inst in hlo_text.parse(self.ref_text).entry:
            if inst.name in cone and inst.name in moved and inst.name in self.values:
                rows = self.runner.compare([moved[inst.name]], [self.values[inst.name]], {"outputs": [
                    {"name": inst.name, "tolerance": self.tolerance}]})
                if not rows[0][1] <= rows[0][2]:
                    return inst.name
        return name

    def failing_output(self):
        """The failing output with the smallest graph (on the full module against expected)."""
        ref, test = self.modules()
        outs = self.run_test(ref, test, range(len(self.inputs)))
        expected = self.runner.load_expected(self.bundle, self.manifest)
        rows = self.runner.compare(outs, expected, self.manifest)
        failing = [k for k, r in enumerate(rows) if not r[1] <= r[2]]
        if not failing:
            raise HarnessInputError(f"reduce {self.bundle}: its module does not fail here (every output within "
                                    "tolerance): nothing to reduce")
        names = ref.outputs()
        sizes = {k: len(hlo_text.live(_rooted_copy(ref, names[k]))) for k in failing}
        k = min(failing, key=lambda k: sizes[k])
        return k, names[k]

    def cut(self, ref, test, params):
        """Bisect for the latest cut (everything before position k feeding k.. replaced) still failing."""
        def at(k):
            inside = {i.name for i in ref.entry[k:]}
            used = {op for i in ref.entry[k:] for op in i.operands}
            names = [i.name for i in ref.entry[:k] if i.name in used and i.name not in inside
                     and i.opcode not in ("parameter", "constant") and i.name in self.values]
            return self.replaced(ref, test, names)
        lo, hi = 0, len(ref.entry) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fails(*at(mid)):
                lo = mid
            else:
                hi = mid - 1
        return at(lo) if lo else (ref, test, params)

    def greedy(self, ref, test, params):
        changed = True
        while changed:
            changed = False
            for inst in reversed(list(ref.entry)):
                if inst.name == ref.root or inst.opcode in ("parameter", "constant") or inst.name not in self.values \
                        or inst.name not in {i.name for i in ref.entry}:
                    continue
                candidate = self.replaced(ref, test, [inst.name])
                if self.fails(*candidate):
                    ref, test, params = candidate
                    changed = True
        return ref, test, params

    def write(self, out_dir, ref, test, params, extra: dict) -> None:
        text = hlo_text.render(ref)
        files = {"module.hlo.txt": text.encode(), "run_hlo.py": (self.bundle / "run_hlo.py").read_bytes(),
                 "check.sh": CHECK_SH.encode()}
        from jaxlib import xla_client

        files["module.hlo.pb"] = xla_client.hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
        manifest = dict(self.manifest, **extra)
        manifest["module"] = dict(manifest["module"], instructions=hlo_text.count(text), proto="module.hlo.pb")
        manifest["params"] = []
        for new, old in enumerate(params):
            spec = dict(self.manifest["params"][old], file=f"inputs/p{new:03d}.npy")
            files[spec["file"]] = (self.bundle / self.manifest["params"][old]["file"]).read_bytes()
            manifest["params"].append(spec)
        files["expected/o000.npy"] = _npy(self.values[ref.root])
        original = next(o for o in self.manifest["outputs"] if o["name"] == extra.get("output", ref.root)) \
            if extra.get("output") else {"name": ref.root, "tolerance": self.tolerance}
        manifest["outputs"] = [dict(original, file="expected/o000.npy", shape=list(self.values[ref.root].shape),
                                    instruction=ref.root)]
        manifest.pop("test_module", None)
        if test is not None:
            files["planted.hlo.txt"] = hlo_text.render(test).encode()
            manifest["test_module"] = "planted.hlo.txt"
        manifest["files"] = {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(files.items())}
        files["README.md"] = readme(manifest).encode()
        with atomic_directory(Path(out_dir)) as tmp:
            for rel, data in files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
            (tmp / "bundle.json").write_text(json.dumps(manifest, indent=1))
        (Path(out_dir) / "check.sh").chmod(0o755)


def _rooted_copy(m, name):
    m = copy.deepcopy(m)
    m.root = name
    return m


def _npy(value) -> bytes:
    array = np.asarray(value)
    if array.dtype.name == "bfloat16":
        array = array.astype(np.float32)
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array))
    return buffer.getvalue()


def reduce_bundle(bundle, out_dir, oracle: str | None = None, say=print) -> tuple[int, int]:
    """Write the reduced bundle to `out_dir`; (instructions before, after)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise HarnessInputError(f"reduce: {out_dir} exists and is not empty; name a new directory")
    r = Reduction(bundle, oracle)
    before = hlo_text.count(r.ref_text)  # the layer graph it started from
    k, name = r.failing_output()
    say(f"reduce: {before} instructions; keeping output {k} ({r.manifest['outputs'][k]['name']}, %{name})")
    ref, test, params = r.rooted(name)
    if not r.fails(ref, test, params):
        raise HarnessInputError(f"reduce {bundle}: output {k} alone does not fail under the oracle")
    first = r.first_failing(name)
    if first != name and r.fails(*r.rooted(first)):  # an instruction nearer the fault fails already
        say(f"reduce: %{first} already fails: it is the output kept")
        ref, test, params = r.rooted(first)
    ref, test, params = r.greedy(*r.cut(ref, test, params))
    after = max(hlo_text.count(hlo_text.render(m)) for m in (ref, test) if m is not None)
    r.write(out_dir, ref, test, params, {"output": r.manifest["outputs"][k]["name"],
                                          "reduced": {"from_instructions": before, "instructions": after,
                                                      "oracle": oracle or f"the bundle's own compare ({r.platform})",
                                                      "oracle_calls": r.calls}})
    say(f"reduce: {before} -> {after} instructions ({after / before:.1%}), {r.calls} oracle runs; "
        f"reduced bundle in {out_dir}")
    shutil.rmtree(out_dir / "__pycache__", ignore_errors=True)
    return before, after
