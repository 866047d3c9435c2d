"""Bench's timings: the one decode loop (harness/port/decode.py `generate`) run as serving runs it,
timed from outside through two hooks and no loop of bench's own (gpt-fast times its `generate`
with a per-token callback; NxD Inference hooks a latency collector onto the model):

- the loop's per-token callback (`observe`) marks when each token is emitted (its argmax taken);
- a tap on the backend (harness/backends/tap.py) marks where each graph call starts and ends.

From these, per sequence (`LoopTimes`):

  TTFT     from entering the loop to the first token (validation, the host embedding, the reset of
           a one-slot cache, every prefill chunk's graph call, the argmax);
  prefill  from entering the loop to the end of the prefill's last graph call;
  a step   from one token to the next (the fed-back token's embedding, the decode graph, argmax);
  graph    the time inside the backend's calls of each of those (the rest is host-side work).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from harness.backends.tap import TappedCall, tap


def _ms(seconds: float) -> float:
    return seconds * 1e3


@dataclass
class LoopTimes:
    """When one run of the loop started, every backend call in it, and when each sequence emitted
    each of its tokens (perf_counter seconds)."""

    start: float = 0.0
    calls: list[TappedCall] = field(default_factory=list)
    tokens: dict[int, list[float]] = field(default_factory=dict)

    def _inside(self, after: float, until: float) -> list[TappedCall]:
        return [c for c in self.calls if c.method == "forward" and after <= c.start and c.end <= until]

    def ttft_ms(self, seq: int = 0) -> float:
        return _ms(self.tokens[seq][0] - self.start)

    def prefill_ms(self, seq: int = 0) -> float:
        return _ms(max(c.end for c in self._inside(self.start, self.tokens[seq][0])) - self.start)

    def prefill_graph_ms(self, seq: int = 0) -> float:
        return _ms(sum(c.seconds for c in self._inside(self.start, self.tokens[seq][0])))

    def step_ms(self, seq: int = 0) -> list[float]:
        marks = self.tokens[seq]
        return [_ms(b - a) for a, b in zip(marks, marks[1:])]

    def step_graph_ms(self, seq: int = 0) -> list[float]:
        marks = self.tokens[seq]
        return [_ms(sum(c.seconds for c in self._inside(a, b))) for a, b in zip(marks, marks[1:])]

    def e2e_ms(self, seq: int = 0) -> float:
        """TTFT plus every step: the prompt to its last token (the marks are contiguous)."""
        return self.ttft_ms(seq) + sum(self.step_ms(seq))

    def last_ms(self) -> list[float]:
        """Per token index, when the slowest sequence emitted it (a batch's step ends with its last row)."""
        return [_ms(max(marks) - self.start) for marks in zip(*self.tokens.values())]


def timed_generate(engine, prompts: list, new_tokens, step=None) -> tuple[list, LoopTimes]:
    """`generate(engine, prompts, new_tokens, step)` once, timed (module doc): (its DecodeResults,
    the LoopTimes). Garbage collection is held off inside: a collection pause is noise, not the
    port's speed."""
    from harness.port.decode import generate, greedy

    times = LoopTimes(tokens={k: [] for k in range(len(prompts))})
    emitted = lambda k, slot, written: times.tokens[k].append(time.perf_counter())  # noqa: E731
    gc.collect()
    gc.disable()
    try:
        with tap(engine.backend, times.calls.append):
            times.start = time.perf_counter()
            results = generate(engine, prompts, new_tokens, step or greedy(), observe=emitted)
    finally:
        gc.enable()
    return results, times
