"""The device calls of one prompt as the engine itself makes them: the engine's decode loop
(harness.port.decode.generate, teacher-forced on the reference's tokens) is run over a backend
seen through a `CallRecorder`, which keeps every backend.forward call's arguments exactly as the
engine passed them (inputs_embeds, positions, seq_ids, last, verify) and stops the loop at the
call a snapshot or repro wants. Nothing here computes a position, a bucket or a KV offset: a
host-side bug in any of them (a chunk's positions, a decode step's start) is in what is recorded.

Call numbering is the engine's: the prefill chunks of `chunk_plan` first, then one call per
teacher-forced decode step (`call_index`). The engine's code is untouched: the recorder stands
where the backend stood (`engine.backend`), forwarding everything else to it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from harness.port.engine import chunk_plan


class _Reached(Exception):
    """Raised by the recorder once the wanted call ran: the rest of the loop is not needed."""


@dataclass
class Call:
    """One backend.forward call as the engine made it (tensors cloned)."""

    inputs_embeds: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor | None = None
    last: int | None = None
    verify: bool = False

    @property
    def first_position(self) -> int:
        """Where the call writes its first row: the KV rows [0, first) are what it reads of the cache."""
        return int(self.positions[0, 0])

    @property
    def real_rows(self) -> int:
        return int((self.positions[0] >= 0).sum())

    def kwargs(self) -> dict:
        return {"seq_ids": self.seq_ids, "last": self.last, "verify": self.verify}


@dataclass
class Recording:
    calls: list[Call] = field(default_factory=list)
    kv: dict[str, torch.Tensor] = field(default_factory=dict)  # the cache rows the wanted call read
    captures: dict[str, torch.Tensor] = field(default_factory=dict)  # the wanted call's, with capture=True

    @property
    def call(self) -> Call:
        return self.calls[-1]


class CallRecorder:
    """Stands in for a backend: records each forward call, runs it, and at call `wanted` first
    takes the KV state through `kv_state(backend, call)`, runs it with captures, then stops."""

    def __init__(self, backend, wanted: int, kv_state=None):
        self._backend, self._wanted, self._kv_state = backend, wanted, kv_state
        self._signature = inspect.signature(backend.forward)
        self.recording = Recording()

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def forward(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        call = Call(clone(a["inputs_embeds"]), clone(a["positions"]), clone(a.get("seq_ids")), a.get("last"),
                    bool(a.get("verify", False)))
        self.recording.calls.append(call)
        if len(self.recording.calls) - 1 < self._wanted:
            return self._backend.forward(*args, **kwargs)
        if self._kv_state is not None:
            self.recording.kv = self._kv_state(self._backend, call)
        a["capture"] = True
        logits, captures = self._backend.forward(*bound.args, **bound.kwargs)
        self.recording.captures = dict(captures, logits=logits)  # the call's output too (a head point's)
        raise _Reached


def call_index(n: int, settings, step: int | None, start: int) -> int:
    """The engine's number of a call of an n-token prompt: its prefill chunk starting at `start`,
    or (a decode step) the teacher-forced step `step` after every chunk."""
    plan = chunk_plan(n, settings.buckets, settings.kv_len)
    if step is not None:
        return len(plan) + step
    return next(i for i, chunk in enumerate(plan) if chunk[0] == start)


def record_calls(engine, ids, tokens: list[int], wanted: int, kv_state=None) -> Recording:
    """The engine's calls for prompt `ids`, teacher-forced on `tokens`, up to and including call
    `wanted` (run with captures; `kv_state` reads the cache just before it)."""
    from harness.port.decode import forced, generate

    recorder = CallRecorder(engine.backend, wanted, kv_state)
    n_prefill = len(chunk_plan(len(ids), engine.settings.buckets, engine.settings.kv_len))
    steps = max(wanted - n_prefill + 2, 1)  # the prefill's token, then one decode call per step
    engine.backend = recorder
    try:
        generate(engine, [ids], steps, forced([list(tokens) + [0] * steps]))
    except _Reached:
        return recorder.recording
    finally:
        engine.backend = recorder._backend
    raise RuntimeError(f"the engine made {len(recorder.recording.calls)} calls for this prompt; call {wanted} never "
                       "came (a decode step past the reference's tokens?)")
