"""The one decode loop: admit and step, for single, batched and speculative runs alike.

`generate(engine, prompts, new_tokens, step=greedy() | forced(tokens) | speculative(drafter, k))`
serves every prompt as a sequence in one of the engine's KV slots (settings.batch; batch 1 is one
slot). Prompts fill the free slots (one prefill call for those admitted together), every live
sequence takes one step per device call, and a finished sequence's slot takes the next prompt
while the others keep going (continuous batching, for all three steps). The step decides what a
call feeds and how many tokens it emits:

- greedy: the argmax of the raw logits, fed back; one decode call, one token per sequence;
- forced: the argmax is emitted (its logits kept) but the given token is fed (teacher forcing);
- speculative: the drafter drafts up to k tokens per sequence from the target's cache of its slot,
  one verify call checks every live sequence's drafts, and each emits its accepted drafts plus
  the target's own token (harness/port/speculate.py holds the round's rules).

Every call goes through the one engine (harness/port/engine.py): rows, positions and KV slots;
which graphs a call runs (batch 1's, or a batch bucket's with `seq_ids`) is the build's detail,
decided there, not a second loop. Every run is first counted against the KV length by the one fit
function (harness.inputs.prompts.kv_positions_used).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.base.errors import HarnessInputError, OptionError, PromptError
from harness.inputs.prompts import check_kv_fit
from harness.port.engine import DecodeResult, PrefillResult, Step
from harness.port import speculate as rounds


@dataclass(frozen=True)
class Greedy:
    name = "greedy"


@dataclass(frozen=True)
class Forced:
    tokens: list  # one token list per prompt, fed instead of the argmax
    name = "forced"


@dataclass(frozen=True)
class Speculative:
    drafter: object
    k: int
    name = "speculative"


def greedy() -> Greedy:
    return Greedy()


def forced(tokens: list) -> Forced:
    return Forced(tokens)


def speculative(drafter, k: int) -> Speculative:
    return Speculative(drafter, k)


@dataclass
class Sequence:
    """A prompt being served: its slot, what it has emitted, and the logits that choose its next token."""

    index: int
    ids: torch.Tensor
    slot: int
    want: int
    prefill: PrefillResult
    position: int = 0  # where its next fed token goes (after its prefill: the prompt's length)
    hidden: torch.Tensor | None = None  # speculative: the target's final-norm state that chose it
    result: DecodeResult = None

    def emit(self, rows) -> None:
        """Tokens of these raw-logit rows (their argmax), up to the tokens asked for."""
        for row in rows:
            if len(self.result.tokens) < self.want:
                self.result.tokens.append(int(row.argmax()))
                self.result.steps.append(row)

    @property
    def finished(self) -> bool:
        return len(self.result.tokens) >= self.want


def generate(engine, prompts: list, new_tokens, step=Greedy(), *, capture: bool = False, observe=None) -> list[DecodeResult]:
    """Every prompt decoded by `step` (module doc) in the engine's KV slots, results in prompt
    order. `new_tokens` an int or one per prompt; `observe(prompt index, slot, written)` after a
    sequence's prefill and after each of its greedy or forced steps."""
    ids = [engine.validate_ids(p) for p in prompts]
    wants = [new_tokens] * len(ids) if isinstance(new_tokens, int) else list(new_tokens)
    draft = engine.settings.speculate if isinstance(step, Speculative) else 0
    for p, want in zip(ids, wants):
        if isinstance(want, bool) or want < 0:
            raise PromptError(f"{want!r} new tokens: ask for 0 or more")
        check_kv_fit(p.numel(), want, engine.kv_len, draft)
    if isinstance(step, Forced) and len(step.tokens) != len(ids):
        raise PromptError(f"{len(step.tokens)} forced token lists for {len(ids)} prompts: give one per prompt")
    if isinstance(step, Speculative):
        _check_speculative(engine, step)
    engine.start()
    queue, live, done = list(range(len(ids))), [], {}
    while queue or live:
        taken = {q.slot for q in live}
        free = [s for s in range(engine.slots) if s not in taken]
        admit, queue = queue[:len(free)], queue[len(free):]
        if admit:
            live += _admit(engine, [ids[i] for i in admit], admit, free, wants=wants, step=step, capture=capture,
                           observe=observe)
        for q in [q for q in live if q.finished]:
            done[q.index] = _result(q)
        live = [q for q in live if not q.finished]
        if live:
            advance = _speculate if isinstance(step, Speculative) else _decode
            advance(engine, live, step, capture=capture, observe=observe)
    return [done[i] for i in range(len(ids))]


def _check_speculative(engine, step: Speculative) -> None:
    if engine.settings.speculate and step.k > engine.settings.speculate:
        raise OptionError(f"--speculate {step.k}: this build's verify graph takes {engine.settings.speculate} drafts "
                          "at most (RunSettings.speculate)")
    if engine.slots > 1 and not getattr(step.drafter, "serves_slots", False):
        raise HarnessInputError(f"--assistant with --batch {engine.slots} on the {engine.backend.name} backend: its drafter "
                                "reads one sequence's cache; drop --batch, or use a drafter that serves slots "
                                "(the cpu, xla and neuron backends' do)")


def _admit(engine, prompts: list, indices: list, free: list, *, wants: list, step, capture: bool,
           observe) -> list[Sequence]:
    """Prefill the admitted prompts into free slots; each emits its first token."""
    at = free[:len(prompts)]
    spec = isinstance(step, Speculative)
    if spec and not engine.backend.returns_captures:
        pres, states = _prefill_by_verify(engine, prompts, at)
    else:
        pres = engine.prefill_rows(prompts, at, capture or spec)
        states = [pre.captures["final_norm"][-1:][None] if spec else None for pre in pres]
    admitted = []
    for i, ids, slot, pre, state in zip(indices, prompts, at, pres, states):
        q = Sequence(i, ids, slot, wants[i], pre, position=ids.numel(), hidden=state,
                     result=DecodeResult(tokens=[], step_logits=torch.empty(0), prefill=pre))
        q.emit(pre.logits[-1:])
        if observe is not None:
            observe(i, slot, ids.numel())
        admitted.append(q)
    return admitted


def _prefill_by_verify(engine, prompts: list, at: list) -> tuple[list, list]:
    """A perf build's prefill graphs return no final-norm state: every prompt token but the last is
    prefilled, the last runs through the verify graph, which returns every row's state."""
    heads = [p[:-1] for p in prompts]
    if any(h.numel() for h in heads):
        ready = [(h, s) for h, s in zip(heads, at) if h.numel()]
        engine.prefill_rows([h for h, _ in ready], [s for _, s in ready], capture=False)
    elif engine.slots == 1:  # nothing prefilled: a one-slot cache starts afresh all the same
        engine.backend.reset()
    steps = engine.verify_rows([p[-1:] for p in prompts], [p.numel() - 1 for p in prompts], at, capture=False)
    pres = [PrefillResult(logits=s.logits[:1]) for s in steps]
    return pres, [s.captures["final_norm"][:1][None] for s in steps]


def _decode(engine, live: list, step, *, capture: bool, observe) -> None:
    """One greedy or forced step of every live sequence: one decode call."""
    fed = [step.tokens[q.index][len(q.result.tokens) - 1] if isinstance(step, Forced) else q.result.tokens[-1]
           for q in live]
    positions = [q.position for q in live]
    for q, out, position in zip(live, engine.decode_rows(fed, positions, [q.slot for q in live], capture), positions):
        q.emit(out.logits[None])
        q.position += 1
        if capture:  # the capture points of the step that chose its latest token
            q.result.step_caps.append(out.captures)
        if observe is not None:
            observe(q.index, q.slot, position + 1)


def _speculate(engine, live: list, step: Speculative, *, capture: bool, observe) -> None:
    """One round of every live sequence: its drafts (the drafter on its slot), then one verify call
    of all of them; each emits its accepted drafts and the target's own token (speculate.py)."""
    rows, positions = [], []
    for q in live:
        r = q.result
        room = min(step.k, q.want - len(r.tokens) - 1, engine.kv_len - q.position - 1)
        if capture:  # what the drafter reads this round: the target's cache of its slot, [0, position)
            r.round_caches.append(engine.read_cache(q.position, q.slot))
        drafts = rounds.draft_round(engine, step.drafter, r.tokens[-1], q.hidden, position=q.position, k=room, out=r,
                             capture=capture, slot=q.slot) if room > 0 else []
        r.drafted.append(drafts)
        rows.append([r.tokens[-1]] + drafts)
        positions.append(q.position)
    for q, out, row in zip(live, engine.verify_rows(rows, positions, [q.slot for q in live], False), rows):
        m = rounds.accepted_prefix(row[1:], [int(g) for g in out.logits.argmax(-1)])
        q.result.accepted.append(m)
        q.emit(out.logits[:m + 1])  # d1..dm equal g0..g(m-1); g(m) is the target's own next token
        q.hidden = out.captures["final_norm"][m:m + 1][None]
        q.position = rounds.next_position(q.position, m, len(row) - 1)


def _result(q: Sequence) -> DecodeResult:
    r = q.result
    r.step_logits = torch.stack(r.steps) if r.steps else torch.empty(0, q.prefill.logits.shape[-1])
    caps = r.step_caps
    r.step_captures = {k: torch.cat([c[k] for c in caps]) for k in caps[0]} if caps else {}
    return r
