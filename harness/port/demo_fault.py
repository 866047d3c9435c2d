"""A failure to look at on CPU (docs/snapshot.md#a-failure-to-look-at): `--demo-fault NAME` plants one
known port bug for the whole command, so a user can watch `check --snapshot`, `replay` and the
repro each exit 1 on the tiny model without a real bug.

It is never enabled silently: only the option plants it; a run with it prints DEMO_BANNER at its
start and end, its JSON result carries `demo_fault`, and the snapshot and repro it writes record it
(the run settings' `demo_fault`, harness.snapshot.write.settings_record) so that `replay` plants it
again (saying so) and the repro's traced layer carries it. The faults are the port's own code
changed, never the reference's."""

from __future__ import annotations

import contextlib

import torch

from harness.base.errors import OptionError


def _rope_pairs(model):
    """rope rotating lanes 2i, 2i+1 instead of i, i + D/2 (a classic port bug: GPT-J style pairs)."""
    def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    return "rotate_half", rotate_pairs


DEMO_FAULTS = {"rope-pairs": _rope_pairs}


def banner(name: str) -> str:
    return (f"*** DEMO FAULT '{name}' PLANTED (--demo-fault): this port is deliberately broken to show the "
            "snapshot -> replay -> repro chain failing; the verdict says nothing about your port ***")


def check_name(name: str | None) -> None:
    if name is not None and name not in DEMO_FAULTS:
        raise OptionError(f"--demo-fault {name!r}: use one of {', '.join(DEMO_FAULTS)} (a planted bug for the "
                          "docs' walkthrough; leave it out for a real run)")


_PLANTED: list = []  # what undoes each fault planted for a command (unplant_all at its end)


def plant(name: str):
    """Plant fault `name` in the port's code; returns what undoes it (also kept for unplant_all)."""
    from harness.port import model

    check_name(name)
    attr, replacement = DEMO_FAULTS[name](model)
    original = getattr(model, attr)
    setattr(model, attr, replacement)
    undo = lambda: setattr(model, attr, original)  # noqa: E731
    _PLANTED.append(undo)
    return undo


def unplant_all() -> None:
    """The command ended: every fault it planted removed (a library caller's process goes on)."""
    while _PLANTED:
        _PLANTED.pop()()


@contextlib.contextmanager
def planted(name: str | None):
    """The fault planted for the block (nothing for None)."""
    if name is None:
        yield
        return
    undo = plant(name)
    try:
        yield
    finally:
        undo()
        _PLANTED.remove(undo)
