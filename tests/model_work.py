"""What model work a command did, counted rather than timed: "refused before model work" is
asserted by what ran (no weight tensor read, no transformers model loaded, no module's forward),
so that a loaded machine cannot turn it red and a fast machine cannot hide a regression.

In-process: `with ModelWork() as work: main(argv)`, then `work.done` lists what ran. In a fresh
process: `python -m tests.model_work LOG ARGV...` runs `gemma-parity ARGV` with the same probes and
appends one line per kind of work to LOG (empty: none).
"""

from __future__ import annotations

import sys
from collections import Counter


class ModelWork:
    """Counts weight reads (Checkpoint.get), transformers model loads (from_pretrained) and module
    forwards (torch.nn.Module.__call__) while active; the calls themselves still run."""

    def __init__(self):
        self.counts: Counter = Counter()
        self._undo: list = []

    def _wrap(self, owner, name: str, kind: str, classmethod_: bool = False) -> None:
        original = owner.__dict__[name]
        func = original.__func__ if classmethod_ else original
        counts = self.counts

        def counted(*args, **kwargs):
            counts[kind] += 1
            return func(*args, **kwargs)

        setattr(owner, name, classmethod(counted) if classmethod_ else counted)
        self._undo.append((owner, name, original))

    def __enter__(self) -> "ModelWork":
        import torch
        from transformers import PreTrainedModel

        from harness.inputs.checkpoint import Checkpoint

        self._wrap(Checkpoint, "get", "weight tensors read")
        self._wrap(PreTrainedModel, "from_pretrained", "transformers models loaded", classmethod_=True)
        self._wrap(torch.nn.Module, "__call__", "module forwards")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def done(self, allow=()) -> dict[str, int]:
        """The kinds of work that ran (kind -> calls), except those in `allow`."""
        return {kind: n for kind, n in self.counts.items() if n and kind not in allow}


def main(argv: list[str]) -> int:
    from harness.cli import main as cli_main

    log, args = argv[0], argv[1:]
    with ModelWork() as work:
        try:
            code = cli_main(args)
        finally:
            with open(log, "a", encoding="utf-8") as f:
                f.writelines(f"{kind}: {n}\n" for kind, n in work.done().items())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
