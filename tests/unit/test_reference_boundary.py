"""The truth never leans on the port (docs/design.md#import-layers, issue 13): the reference path imports nothing of
the port — not the decoder (model), the engine, the TP plan (sharding), the backends, nor the
port's numerics (embedding scale, softcap) — so a port bug cannot leak into what it is judged
against. Checked statically (every import, transitively) and by behaviour (a broken port
leaves the reference's numbers unchanged)."""

from __future__ import annotations

import ast

import pytest
import torch

from tests.unit.test_layering import PACKAGE, harness_imports, module_name

REFERENCE_PATH = ("harness.reference.run", "harness.reference.stream", "harness.reference.float64")
PORT = ("harness.port.model", "harness.port.engine", "harness.port.sharding", "harness.backends", "harness.port.graphs",
        "harness.base.numerics")


def module_file(name: str):
    path = PACKAGE.parent / (name.replace(".", "/") + ".py")
    return path if path.is_file() else PACKAGE.parent / name.replace(".", "/") / "__init__.py"


def reachable(start: tuple[str, ...], imports_of) -> dict[str, list[str]]:
    """Every harness module reachable from `start` by imports, with the chain that reaches it."""
    chains = {m: [m] for m in start}
    todo = list(start)
    while todo:
        module = todo.pop()
        for target in sorted(imports_of(module)):
            if target not in chains:
                chains[target] = chains[module] + [target]
                todo.append(target)
    return chains


def port_leaks(start, imports_of) -> list[str]:
    return [" -> ".join(chain) for name, chain in reachable(start, imports_of).items()
            if name.startswith(PORT)]


def _imports_on_disk(module: str) -> set[str]:
    path = module_file(module)
    return harness_imports(path) if path.is_file() else set()


def test_reference_path_imports_no_port_code():
    """harness.reference.run and everything it imports, transitively, stay clear of the port."""
    assert port_leaks(REFERENCE_PATH, _imports_on_disk) == []
    assert "harness.reference.run" in {module_name(p) for p in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize("source", [
    "from harness.base.numerics import softcap",
    "import harness.port.engine",
    "def f():\n    from harness.port.model import rms_norm\n",
    "from harness.inputs.checkpoint import Checkpoint",  # checkpoint itself is clean, but see below
])
def test_the_boundary_check_catches_a_leaning_reference(tmp_path, source):
    """The checker itself: a reference importing port code directly, inside a function, or through
    a module that does is reported."""
    path = tmp_path / "run.py"
    path.write_text(source)
    graph = {"harness.reference.run": harness_imports(path),
             "harness.inputs.checkpoint": {"harness.base.numerics"}}  # a weight reader that leaned on the port
    leaks = port_leaks(REFERENCE_PATH, lambda m: graph.get(m, set()))
    assert leaks and all(chain.startswith("harness.reference.run") for chain in leaks)
    assert ast.parse(source)  # the sample is valid Python


def test_broken_port_numerics_leave_the_reference_unchanged(monkeypatch, tiny0_ckpt, default_prompts):
    """Break the port's embedding scale and softcap at their source: the streamed reference (which
    builds its own embeddings and caps its own logits) computes the same numbers bit for bit."""
    from harness.base import numerics
    from harness.port import engine
    from harness.reference.stream import stream_prefill_captures

    prompt = default_prompts[1]
    before = stream_prefill_captures(tiny0_ckpt, prompt, torch.bfloat16)
    monkeypatch.setattr(numerics, "embed_scale", lambda hidden, dtype: torch.tensor(hidden ** 0.5 + 1.0))
    monkeypatch.setattr(numerics, "softcap", lambda logits, cap: logits.float() * 0)
    monkeypatch.setattr(engine, "embed_scale", numerics.embed_scale)
    monkeypatch.setattr(engine, "softcap", numerics.softcap)
    after = stream_prefill_captures(tiny0_ckpt, prompt, torch.bfloat16)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_streaming_bf16_equals_the_full_reference_on_inexact_scale(inexact_scale_ckpt, inexact_scale_reference):
    """On the hidden-72 variant (sqrt(72) is inexact in bf16, so the scale's cast shows) the streamed
    bf16 reference's embeddings equal the full transformers model's bit for bit, and every other
    prefill capture agrees to bf16 rounding of the different op order (layer by layer vs whole model)."""
    from harness.reference.stream import stream_prefill_captures

    for full in inexact_scale_reference["bfloat16"][:2]:
        streamed = stream_prefill_captures(inexact_scale_ckpt, full.prompt, torch.bfloat16)
        assert torch.equal(streamed["embeddings"], full.captures["embeddings"])
        for name, tensor in streamed.items():
            err = float((tensor - full.captures[name]).norm() / full.captures[name].norm())
            assert err < 1e-2, (name, err)
