"""A host-step snapshot replayed (harness/snapshot/host.py's kinds): the port's own host code run
again on the recorded inputs, over a stand-in device where the step needs one, and judged by the
rule the check judged it with."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

class RecordedDevice:
    """Stands where the backend stands for a host-step replay: it computes nothing and answers each
    call with the logits the device returned when the run was recorded, placed by position (the
    prompt's last row gives the first token; a decode step at position p, the token after it)."""

    name, last_row_only, returns_captures, reads_cache, host_ranks, tp = "recorded", False, True, False, False, 1

    def __init__(self, logits: torch.Tensor, prompt_length: int):
        self.logits, self.n = logits, prompt_length

    def reset(self) -> None:
        pass

    def forward(self, inputs_embeds, positions, capture=False, last=None, seq_ids=None, verify=False):
        out = torch.zeros(1, positions.shape[1], self.logits.shape[-1])
        for col, position in enumerate(positions[0].tolist()):
            step = position - self.n + 1
            if step >= self.logits.shape[0]:
                raise IndexError(f"the host loop asked the device for position {position}, past the recorded run "
                                 f"({self.logits.shape[0]} tokens after a {self.n}-token prompt)")
            if step >= 0:
                out[0, col] = self.logits[step]
        return out, {}


@dataclass
class HostReplay:
    """One host step replayed (the same host code whatever the backend named) and judged."""

    backend: str
    tp: int
    kind: str
    failure: str | None  # what breaks the judge, or None
    agreement: str = ""
    mode: str = "host step"
    rerouted: tuple = ()  # a host step runs no router

    @property
    def reproduces(self) -> bool:
        return self.failure is not None

    def describe(self) -> str:
        head = f"{self.backend} ({self.mode} {self.kind}: no device call, the port's host code): "
        return head + (f"REPRODUCES: {self.failure}" if self.failure else f"agrees: {self.agreement}")


def host_engine(checkpoint, settings, backend=None):
    """The port's host side as the engine builds it (harness.backends.build_engine), over `backend`."""
    from harness.port.engine import Engine

    spec, dtype = checkpoint.spec, settings.torch_dtype
    table = checkpoint.per_layer_table(dtype) if spec.per_layer_input_size else None
    return Engine(spec, backend, checkpoint.embed_weight(dtype), settings, per_layer_table=table)


def replay_host(snap, checkpoint, backend_name: str, tp: int) -> HostReplay:
    """The snapshot's host step run again by the current port code on the recorded inputs."""
    kind, t = snap.target["host"], snap.tensors
    settings = snap.run_settings(backend="cpu", tp=1)
    try:
        failure, agreement = _JUDGED[kind](snap, checkpoint, settings, t)
    except Exception as exc:  # an exception inside the port's host code: the check's failure too
        failure, agreement = f"the host step raised {type(exc).__name__}: {exc}", ""
    return HostReplay(backend_name, tp, kind, failure, agreement)


def _embed(snap, checkpoint, settings, t):
    ids, ref = t["host.ids"], t["host.ref"]
    out = host_engine(checkpoint, settings).embed(ids)[0, :, :ref.shape[-1]]
    differs = (out.float() != ref.float()).any(-1)
    if bool(differs.any()):
        worst = float((out.double() - ref.double()).abs().max())
        return (f"embeddings: {int(differs.sum())} of {ids.numel()} rows not bit-exact with the "
                f"{settings.dtype} reference's lookup (largest difference {worst:.3e})"), ""
    return None, f"all {ids.numel()} rows bit-exact with the {settings.dtype} reference's lookup"


def _probabilities(snap, checkpoint, settings, t):
    from harness.judge.compare import compare_probabilities

    probs = host_engine(checkpoint, settings).probabilities(t["host.logits"])
    found = compare_probabilities(snap.target["point"], probs, t["host.ref"])
    text = f"{found.name}: ratio {found.ratio:.3g} (limit 1), total variation {found.total_variation_max:.3e}"
    return (text, "") if not found.passed else (None, text)


def _tokens(snap, checkpoint, settings, t):
    from harness.judge.compare import JUDGES
    from harness.judge.tokens import classify_departure
    from harness.port import decode  # through the module: the port's decode loop as it is now

    logits, ids = t["host.logits"], t["host.ids"]
    engine = host_engine(checkpoint, settings, RecordedDevice(logits, ids.numel()))
    free = decode.generate(engine, [ids], logits.shape[0])[0]
    captures = {"step_capped_logits": t["host.ref_capped"]} if "host.ref_capped" in t else {}
    reference = SimpleNamespace(generated=t["host.ref_tokens"].tolist(), step_logits=t["host.ref_logits"],
                                captures=captures)
    verdict = classify_departure(reference, free, float(t["host.band"]), judge=JUDGES[snap.target["stage"]])
    if verdict is None:
        return None, f"the {len(free.tokens)} reported tokens are the reference's"
    text = f"sequence: step {verdict.position} {verdict.kind}: {verdict.evidence}"
    return (None, text) if verdict.accounted else (text, "")


def _raises(snap, checkpoint, settings, t):
    from harness.snapshot.host_raises import HostCalls, judge_raises

    device = HostCalls()
    return judge_raises(snap, host_engine(checkpoint, settings, device), device, t)


_JUDGED = {"embed": _embed, "probabilities": _probabilities, "tokens": _tokens, "raises": _raises}
