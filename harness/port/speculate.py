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
where the verify graph's rounding differs from the decode graph's at a near tie."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.base.errors import OptionError, PromptError
from harness.inputs.prompts import check_kv_fit, kv_positions_used

MAX_SPECULATE = 16


@dataclass
class SpeculativeResult:
    tokens: list[int]
    step_logits: torch.Tensor  # [new_tokens, vocab] raw fp32: the target's logits that chose each token
    accepted: list[int]  # accepted draft tokens per verify call
    drafted: list[list[int]]  # the draft tokens of each round
    draft_captures: list[dict] = field(default_factory=list)  # per draft step, with capture
    draft_inputs: list[dict] = field(default_factory=list)  # per draft step: position, token, state fed
    round_caches: list = field(default_factory=list)  # per round, with capture: Engine.read_cache(position)

    @property
    def verifies(self) -> int:
        return len(self.accepted)

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens per verify call (0..k)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


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


def draft_round(engine, drafter, token: int, hidden: torch.Tensor, *, position: int, k: int, out: SpeculativeResult,
                capture: bool) -> list[int]:
    drafts, state, last = [], hidden, token
    for _ in range(k):
        embeds = engine.embed(torch.tensor([last]))[..., :engine.spec.hidden_size]
        logits, new_state, caps = drafter.step(embeds, state.to(embeds.dtype), position, capture)
        if capture:
            out.draft_inputs.append({"position": position, "token": last, "state": state.float(), "round": len(out.drafted)})
            out.draft_captures.append(caps)
        last, state = int(logits.argmax()), next_state(state, new_state)
        drafts.append(last)
    return drafts


def prompt_state(engine, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: the logits of the prompt's last position [vocab] and the target's final-norm state
    there [1, 1, H] (the first draft's input). A parity build captures it in the prefill; a perf
    build of a compiled backend does not (its prefill graphs return the last row's logits only), so
    there every prompt token but the last is prefilled and the last runs through the verify graph,
    which returns every row's final-norm state (graphs.TracedDecoder)."""
    if engine.backend.returns_captures:
        pre = engine.prefill(ids, capture=True)
        return pre.logits[-1], pre.captures["final_norm"][-1:][None]
    if ids.numel() > 1:
        engine.prefill(ids[:-1])
    else:
        engine.backend.reset()
    step = engine.verify(ids[-1:], ids.numel() - 1)
    return step.logits[0], step.captures["final_norm"][:1][None]


def speculative_generate(engine, drafter, ids, new_tokens: int, k: int, capture: bool = False) -> SpeculativeResult:
    """Greedy decode of `new_tokens` tokens with drafts of k tokens verified in one call each."""
    ids = engine.validate_ids(ids)
    n = ids.numel()
    check_kv_fit(n, new_tokens, engine.kv_len, engine.settings.speculate)
    if engine.settings.speculate:
        if k > engine.settings.speculate:
            raise OptionError(f"--speculate {k}: this build's verify graph takes {engine.settings.speculate} drafts "
                              "at most (RunSettings.speculate)")
    logits, hidden = prompt_state(engine, ids)
    out = SpeculativeResult(tokens=[int(logits.argmax())], step_logits=torch.empty(0), accepted=[], drafted=[])
    steps, position = [logits], n
    while len(out.tokens) < new_tokens:
        room = min(k, new_tokens - len(out.tokens) - 1, engine.kv_len - position - 1)
        if capture:  # what the drafter reads this round: the target's cache [0, position)
            out.round_caches.append(engine.read_cache(position))
        drafts = draft_round(engine, drafter, out.tokens[-1], hidden, position=position, k=room, out=out,
                                                 capture=capture) if room > 0 else []
        rows, caps = engine.verify([out.tokens[-1]] + drafts, position)  # caps: final_norm on every build
        greedy = [int(g) for g in rows.argmax(-1)]
        m = accepted_prefix(drafts, greedy)
        out.drafted.append(drafts)
        out.accepted.append(m)
        out.tokens += greedy[:m + 1]  # d1..dm equal g0..g(m-1); g(m) is the target's own next token
        steps += list(rows[:m + 1])
        hidden, position = caps["final_norm"][m:m + 1][None], next_position(position, m, len(drafts))
    out.step_logits = torch.stack(steps)[:new_tokens]
    out.tokens = out.tokens[:new_tokens]
    return out
