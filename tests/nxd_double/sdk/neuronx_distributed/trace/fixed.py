"""What a trace fixes: the double's model of a traced graph's Python.

A trace runs the module's Python once; the graph is what that run did. So (1) a Python branch or
number taken from a tensor's value (`bool(t)`, `t.item()`, `int(t)`, `float(t)`, `t.tolist()`) is
the trace-time value in every later call of that graph, and (2) a plain tensor attribute of a
module (neither parameter nor buffer) that forward reads is a constant at its trace-time value.
The double records (1) while tracing and replays the recorded values on every call, and restores
(2) to their trace-time values before every call; a call that asks for more values than the trace
did is refused (the graph would not have that code).
"""

from __future__ import annotations

import contextlib
import threading

import torch

_LOCAL = threading.local()
_METHODS = ("__bool__", "item", "__int__", "__float__", "tolist")
_ORIGINAL = {name: getattr(torch.Tensor, name) for name in _METHODS}


def _patched(name):
    original = _ORIGINAL[name]

    def method(self, *args, **kwargs):
        mode = getattr(_LOCAL, "mode", None)
        if mode is None:
            return original(self, *args, **kwargs)
        kind, values = mode
        if kind == "record":
            value = original(self, *args, **kwargs)
            values.append((name, value))
            return value
        if not values:
            raise RuntimeError(f"the graph reads a tensor's value ({name}) that its trace did not: a trace "
                               "fixes Python control flow; this call's code path differs from the trace's")
        recorded_name, value = values.pop(0)
        if recorded_name != name:
            raise RuntimeError(f"the call reads {name} where its trace read {recorded_name}")
        return value

    return method


_installed = 0
_lock = threading.Lock()


@contextlib.contextmanager
def _mode(kind, values):
    global _installed
    with _lock:
        if not _installed:
            for name in _METHODS:
                setattr(torch.Tensor, name, _patched(name))
        _installed += 1
    previous = getattr(_LOCAL, "mode", None)
    _LOCAL.mode = (kind, values)
    try:
        yield values
    finally:
        _LOCAL.mode = previous
        with _lock:
            _installed -= 1
            if not _installed:
                for name in _METHODS:
                    setattr(torch.Tensor, name, _ORIGINAL[name])


def recording():
    """Context: every tensor value Python reads on this thread is recorded (the trace)."""
    return _mode("record", [])


def replaying(values):
    """Context: Python reads of tensor values return `values` in order (a call of the graph)."""
    return _mode("replay", list(values))


def _tensorish(value) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value))


def plain_attributes(module: torch.nn.Module) -> dict:
    """(submodule path, name) -> value of every plain attribute holding tensors, or None."""
    found = {}
    for path, sub in module.named_modules():
        for name, value in vars(sub).items():
            if not name.startswith("_") and (value is None or _tensorish(value)):
                found[(path, name)] = value
    return found


def fixed_attributes(before: dict, after: dict) -> dict:
    """The plain tensor attributes a trace fixes: those holding tensors before or after it, at their
    trace-time (before) values, copied."""
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        return type(value)(copy(v) for v in value) if isinstance(value, (tuple, list)) else value

    return {key: copy(before.get(key)) for key in set(before) | set(after)
            if _tensorish(before.get(key)) or _tensorish(after.get(key))}


def restore_attributes(module: torch.nn.Module, fixed: dict) -> None:
    for (path, name), value in fixed.items():
        setattr(module.get_submodule(path) if path else module, name,
                value.clone() if isinstance(value, torch.Tensor) else value)
