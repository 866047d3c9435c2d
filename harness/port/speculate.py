"""Speculative greedy decoding: draft k tokens with the assistant, verify them with one target call,
accept the longest prefix that matches the target's own greedy choice, plus the target's token
after it (docs/speculative.md).

A round at position p (the last token t, not yet in the cache; h, the target's final-norm state
that chose t): the drafter drafts d1..dk at the constant position p, each step fed the target's
embedding of the previous token and the previous step's post-projection (h on the first); the
target then verifies [t, d1..dk] at positions p..p+k, writing k+1 cache entries; greedy g0..gk are
the argmaxes of its k+1 rows; m = the number of leading di equal to g(i-1); d1..dm and g(m) are
emitted, and the next round starts at p+m+1 with h = the verify's state at row m. The rejected
entries (positions p+m+1..p+k) stay in their slots unseen: masks go by position, and the next
verify overwrites them (Engine.verify). The output equals the target's own greedy decode except
where the verify graph's rounding differs from the decode graph's at a near tie. The rounds run in
the one decode loop (harness/port/decode.py `speculative(drafter, k)`), a sequence per KV slot."""

from __future__ import annotations

import torch

from harness.base.errors import OptionError, PromptError
from harness.inputs.prompts import kv_positions_used

MAX_SPECULATE = 16


def check_speculate(k: int, settings) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATE:
        raise OptionError(f"--speculate {k!r}: the draft length must be an integer in [1, {MAX_SPECULATE}]")
    if settings.sliding_cache != "linear":
        raise OptionError(f"--speculate with --sliding-cache {settings.sliding_cache}: a verify call writes entries "
                          "that may be rejected, and a ring overwrites slots still in the window; use the "
                          "linear sliding cache")


def check_verify_fit(prompt_len: int, new_tokens: int, k: int, kv_len: int) -> None:
    """Every verify of a speculative decode fits the cache: the last one, at position prompt_len +
    new_tokens - 2 at most, is padded to k+1 rows (Engine.verify), whose slots must exist."""
    if kv_positions_used(prompt_len, new_tokens, k) > kv_len:
        raise PromptError(f"{prompt_len} prompt + {new_tokens} new tokens with --speculate {k}: the last verify "
                          f"(k+1 = {k + 1} rows) would pass the KV length {kv_len}; leave {k} more slots "
                          "(--kv-len) or ask for fewer new tokens")


def accepted_prefix(drafts: list[int], greedy: list[int]) -> int:
    """How many leading drafts equal the target's greedy choice at the row before them."""
    m = 0
    while m < len(drafts) and drafts[m] == greedy[m]:
        m += 1
    return m


def next_state(fed: torch.Tensor, produced: torch.Tensor) -> torch.Tensor:
    """The state the next draft step is fed: this step's post-projection."""
    return produced


def next_position(position: int, accepted: int, drafted: int) -> int:
    """Where the next round starts: after the accepted drafts and the target's own token. The
    rejected entries past it are rolled back by position alone (Engine.verify)."""
    return position + accepted + 1


def draft_round(engine, drafter, token: int, hidden: torch.Tensor, *, position: int, k: int, out, capture: bool,
                slot: int = 0) -> list[int]:
    """k drafts at the constant `position` from the target's cache of `slot`, recorded in `out` (a
    DecodeResult: with capture, each step's inputs and captures)."""
    drafts, state, last = [], hidden, token
    for _ in range(k):
        embeds = engine.embed(torch.tensor([last]))[..., :engine.spec.hidden_size]
        on_slot = {"slot": slot} if getattr(drafter, "serves_slots", False) else {}  # else one slot (decode.py)
        logits, new_state, caps = drafter.step(embeds, state.to(embeds.dtype), position, capture, **on_slot)
        if capture:
            out.draft_inputs.append({"position": position, "token": last, "state": state.float(), "round": len(out.drafted)})
            out.draft_captures.append(caps)
        last, state = int(logits.argmax()), next_state(state, new_state)
        drafts.append(last)
    return drafts
