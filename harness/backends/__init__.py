"""Backends run the per-rank decoder: `cpu` here and in CI, `neuron` on inf2 (the only Neuron code),
`xla` (the device graphs through torch-xla on CPU, on the Neuron host's torch 2.9).

`Backend` is the interface every backend implements, with its capabilities stated as attributes
(no caller probes with hasattr). `build_engine` puts a backend, built from a `RunSettings`, behind
the host engine: what every workflow runs. docs/design.md#backends describes the three.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ClassVar, Mapping, Protocol, runtime_checkable

import torch

from harness.base.errors import OptionError
from harness.base.settings import RunSettings
from harness.port.engine import Engine

BACKENDS = ("cpu", "neuron", "xla")


@runtime_checkable
class Backend(Protocol):
    """What the engine and the workflows may ask of a backend.

    Built as `Cls(checkpoint, settings, capture=..., **options)`: `capture=True` asks for a parity
    build (captures as extra graph outputs), otherwise a perf build; `options` are the backend's
    own, declared in `OPTIONS` (name -> converter from the command line's text).

    Capabilities:
      returns_captures  forward(capture=True) returns the capture points (a parity build)
      last_row_only     forward returns only row `last` of the logits (a perf build of a compiled
                        backend); the engine then passes `last`
      reads_cache       kv_cache(layer, rank) reads the device KV cache back
      host_ranks        the ranks are modules on this host (`ranks`, `on_ranks`): a layer can be
                        run alone on them (the local verdict of check and bisect)
      serves_batch      forward takes rows naming their KV slots (`seq_ids`) of a cache of
                        settings.batch sequences (harness/port/engine.py, harness/port/kv_slots.py)
      drafts_on_device  the build holds the assistant's draft graphs (settings.assistant): it is
                        built with `assistant=`, the AssistantCheckpoint the command opened; the
                        others' drafter is built on the host (build_drafter)
    `compiler_args` are the flags its graphs were compiled with (empty where nothing is compiled
    ahead of time); a bench result records them.
    """

    name: ClassVar[str]
    OPTIONS: ClassVar[Mapping[str, Callable]]
    spec: object
    tp: int
    returns_captures: bool
    last_row_only: bool
    reads_cache: bool
    host_ranks: bool
    serves_batch: bool
    drafts_on_device: bool
    compiler_args: tuple | list

    def reset(self) -> None:
        """Zero (or forget) the KV cache before a new prompt."""

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, capture: bool = False,
                last: int | None = None, verify: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """inputs_embeds [1, s, hidden], positions [1, s] -> (raw logits [1, s, vocab] (or [1, 1,
        vocab], row `last`, on a last_row_only build), captures name -> [1, s, ...]); the captures
        are empty unless `capture` is asked of a build that returns them. `verify`: a speculative
        verify call (Engine.verify), run by the build's verify graph (graphs.VERIFY_TAG): every row's
        logits, and on a perf build {"final_norm": ...} as its captures."""

    def kv_cache(self, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer's cache on one rank, on the host: [1, kv_heads, kv_len, head_dim]."""


def backend_class(name: str) -> type:
    """The class of a backend by name; the Neuron one is imported only when asked for (importing
    it needs no SDK)."""
    if name == "cpu":
        from harness.backends.cpu import CpuBackend

        return CpuBackend
    if name == "neuron":
        from harness.backends.neuron import NeuronBackend

        return NeuronBackend
    if name == "xla":
        from harness.backends.xla import XlaBackend

        return XlaBackend
    raise OptionError(f"--backend {name!r}: unknown backend; choose one of {', '.join(BACKENDS)}")


def backend_options(name: str, options: Mapping[str, object]) -> dict[str, object]:
    """`options` converted by the backend's declared converters; an option it does not declare, or
    a value its converter refuses, is bad input naming the option."""
    declared = backend_class(name).OPTIONS
    converted = {}
    for key, value in options.items():
        if key not in declared:
            known = ", ".join(sorted(declared)) or "none"
            raise OptionError(f"--backend-option {key}: the {name} backend has no such option "
                              f"(its options: {known})")
        try:
            converted[key] = declared[key](value)
        except (TypeError, ValueError) as exc:
            raise OptionError(f"--backend-option {key}={value!r}: {exc}") from None
    return converted


def make_backend(checkpoint, settings: RunSettings, capture: bool = False, assistant=None):
    """A backend built for this checkpoint from `settings` (a parity build when `capture`); a backend
    that drafts on its device takes `assistant` (the opened settings.assistant; None: it opens it)."""
    options = backend_options(settings.backend, settings.backend_options)
    cls = backend_class(settings.backend)
    if cls.drafts_on_device and settings.assistant is not None:
        options["assistant"] = assistant
    return cls(checkpoint, settings, capture=capture, **options)


def build_engine(checkpoint, settings: RunSettings, capture: bool = False, assistant=None) -> Engine:
    """The host engine over a backend built from `settings` for this checkpoint; `assistant`: the
    AssistantCheckpoint of settings.assistant the command already opened (make_backend)."""
    be = make_backend(checkpoint, settings, capture=capture, assistant=assistant)
    table = checkpoint.per_layer_table(settings.torch_dtype) if checkpoint.spec.per_layer_input_size else None
    return Engine(checkpoint.spec, be, checkpoint.embed_weight(settings.torch_dtype), settings, per_layer_table=table)


def backend_unavailable(name: str) -> str | None:
    """Why `name` cannot run in this environment (the packages it needs), or None: for commands
    that do long work before they build the port (quality's reference pass) to refuse first."""
    import importlib.util

    from harness.base.errors import HarnessInputError

    if name == "neuron":
        from harness.backends.neuron_packages import check_neuron_packages

        try:
            check_neuron_packages()
        except HarnessInputError as exc:
            return str(exc)
    elif name == "xla" and importlib.util.find_spec("torch_xla") is None:
        from harness.backends.xla_env import INSTALL_COMMAND

        return f"the xla backend needs torch-xla, which this environment lacks; install it: {INSTALL_COMMAND}"
    return None


def build_drafter(engine, assistant):
    """The assistant's drafter on the engine's backend, reading its target's cache
    (docs/speculative.md). On neuron the drafter's graphs are part of the target's compiled model,
    built when the run's settings name the assistant (RunSettings.assistant): found there."""
    name = getattr(engine.backend, "name", None)
    if name == "neuron":
        drafter = engine.backend.drafter
        if drafter is None:
            raise OptionError("--assistant on the neuron backend: this build has no draft graphs (the drafter runs "
                              "in the target's compiled model); build the engine from settings naming the assistant "
                              "(RunSettings.assistant, which `--assistant DIR` sets)")
        if Path(engine.backend.assistant.path).resolve() != Path(assistant.path).resolve():
            raise OptionError(f"--assistant {assistant.path}: the neuron build's draft graphs were made for another "
                              f"assistant ({engine.backend.assistant.path}); build the engine with this one")
        return drafter
    if name == "cpu":
        from harness.backends.cpu_drafter import CpuDrafter

        return CpuDrafter(engine.backend, assistant)
    if name == "xla":
        from harness.backends.xla_drafter import XlaDrafter

        return XlaDrafter(engine.backend, assistant)
    raise OptionError(f"--assistant on the {name} backend: the drafter is ported to the cpu, xla and neuron "
                      "backends (docs/speculative.md); use one of them")
