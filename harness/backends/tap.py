"""A tap on a backend: a callback told of every call the engine makes to it (`forward`, `reset`),
with its arguments and when it started and ended. NxD Inference hooks a latency collector onto its
model the same way; nothing of the engine or the backend changes, and the tap is gone on leaving.

`bench` times the one decode loop through it (harness/perf/timing.py): the time inside the graph
calls and where each call ends. The snapshot recorder (harness/snapshot/calls.py) and the host-step
stand-ins still stand in for the backend themselves; they are the tap's next users.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class TappedCall:
    """One call of the backend as the engine made it (the arguments as passed, not copied)."""

    method: str  # "forward" or "reset"
    start: float  # time.perf_counter() at the call and at its return
    end: float
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """"reset", "verify", "decode" (one row per sequence: the decode graph) or "prefill"."""
        if self.method != "forward":
            return self.method
        if self.kwargs.get("verify"):
            return "verify"
        return "decode" if self.args[1].shape[1] == 1 else "prefill"


@contextmanager
def tap(backend, on_call):
    """While inside, `on_call(TappedCall)` after every `backend.forward` and `backend.reset`
    returns (or raises). The backend object itself is hooked, so every holder of it (the engine,
    a drafter reading its cache) is seen through the tap."""
    own = {name: vars(backend)[name] for name in ("forward", "reset") if name in vars(backend)}

    def hooked(name):
        method = getattr(backend, name)

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                on_call(TappedCall(name, start, time.perf_counter(), args, kwargs))
        return call

    backend.forward, backend.reset = hooked("forward"), hooked("reset")
    try:
        yield backend
    finally:
        for name in ("forward", "reset"):
            if name in own:
                setattr(backend, name, own[name])
            else:
                delattr(backend, name)
