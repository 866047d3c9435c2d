"""Progress of long runs (reference, check, bisect, bench): one tqdm status line on stderr.

Shown only when stderr is a terminal, so logs, pipes and CI output stay clean (transformers' own
bars too: third_party_bars); with
GEMMA_PARITY_PROGRESS=1 a plain "[label] text" line per step is written instead where stderr is not a
terminal (a CI log that wants them). `enabled=False` silences it everywhere (library callers, tests).
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def interactive() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def lines_wanted() -> bool:
    return os.environ.get("GEMMA_PARITY_PROGRESS", "") not in ("", "0")


class Status:
    """`status("bisect")("layer 3/48 alone")` updates one line labelled [bisect]; counts steps."""

    def __init__(self, label: str, enabled: bool = True, total: int | None = None):
        self.label, self.total = label, total
        self.enabled = enabled and interactive()
        self.lines = enabled and not self.enabled and lines_wanted()
        self._bar: tqdm | None = None

    def __call__(self, text: str, advance: int = 1) -> None:
        if self.lines:
            print(self.line(text), file=sys.stderr, flush=True)
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = tqdm(total=self.total, desc=f"[{self.label}]", file=sys.stderr, leave=False,
                             dynamic_ncols=True, bar_format="{desc} ({elapsed})")
        self._bar.update(advance)
        # The text goes into the description: tqdm prefixes a postfix with ", " ("[port] , prompt 1/5").
        self._bar.set_description_str(self.line(text))  # redrawn on every step: layers and prompts, not ops

    def line(self, text: str) -> str:
        return f"[{self.label}] {text}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Status":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def third_party_bars() -> None:
    """transformers' own bars ("Loading weights", "Writing model shards") follow the same policy:
    where stderr is not a terminal they are silenced (the harness's own lines, with
    GEMMA_PARITY_PROGRESS=1, say what runs); on a terminal they are left as they are."""
    if interactive():
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def status(label: str, enabled: bool = True, total: int | None = None) -> Status:
    return Status(label, enabled, total)
