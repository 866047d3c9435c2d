"""The `raises` host step (harness/snapshot/host.py's kinds): an exception inside the port's host
code. The check's stage that raised keeps no observation, only its references
(CheckResult.references); the recorder runs the port again as the stage ran each prompt (the
teacher-forced run, then the free one: harness.parity.observe.run_port_prompt's order) with the
engine's two host steps watched (Engine.prefill_rows, Engine.decode_rows: one sequence's prefill or decode step) until one raises, and keeps
that step's arguments as the decode loop passed them.

Tensors: host.ids (the prompt's ids for a prefill; the one fed token for a decode step),
host.positions (the positions the step must embed: the prompt's, or the one decode position),
host.row_ids, host.rows (the embedding rows the ids touch), host.ref (the same-dtype reference's
embeddings at those positions: its layer-0 input). The manifest's target names the step
(`step`: "prefill" or "decode_step") and what it raised (`raised`). The replay runs the step again
through the port's code over `HostCalls` (a stand-in that keeps each device call's inputs and
computes nothing): raising reproduces (the check's own rule: an exception inside the port fails);
otherwise every position the step must embed is judged bit for bit against the reference's row.
An exception raised inside the device call itself is not a host step: refused, naming its frame."""

from __future__ import annotations

import torch

from harness.base.errors import OptionError


class _Raised(Exception):
    def __init__(self, step: str, args: tuple, exc: BaseException, in_device: bool):
        super().__init__(str(exc))
        self.step, self.args_, self.exc, self.in_device = step, args, exc, in_device


def _watch(engine):
    """Wrap the engine's host steps and its backend's forward on the instance (the class's own,
    planted faults included, run inside): a raise comes out as _Raised naming the step."""
    state = {"device": False}
    forward = engine.backend.forward

    def device_call(*args, **kwargs):
        state["device"] = True
        out = forward(*args, **kwargs)
        state["device"] = False
        return out

    def watched(name, rows):
        method = getattr(engine, rows)

        def run(*args, **kwargs):
            state["device"] = False
            try:
                return method(*args, **kwargs)
            except _Raised:
                raise
            except Exception as exc:  # the port's failure, recorded as its one-row step (`name`) of one sequence
                raise _Raised(name, tuple(a[0] for a in args[:2 if name == "decode_step" else 1]), exc,
                              state["device"]) from exc

        return run

    engine.backend.forward = device_call
    engine.prefill_rows, engine.decode_rows = watched("prefill", "prefill_rows"), watched("decode_step", "decode_rows")


def find_raise(checkpoint, settings, references) -> tuple[int, _Raised]:
    """(prompt, the raise) of the port run again on the stage's references, prompt by prompt."""
    from harness.parity.observe import build_port
    from harness.port import decode

    try:
        engine = build_port(checkpoint, settings)
    except Exception as exc:  # the port's failure, but in its build: no step of a run is behind it
        raise OptionError(f"--snapshot: the port raises while it is built ({type(exc).__name__}: {exc}): no call and "
                          "no host step is behind it; the check's verdict names the frame (docs/snapshot.md)") from None
    _watch(engine)
    for k, r32 in enumerate(references.fp32):
        try:
            decode.generate(engine, [r32.prompt], len(r32.generated), decode.forced([r32.generated]))
            if r32.generated:
                decode.generate(engine, [r32.prompt], len(r32.generated))
        except _Raised as raised:
            if raised.in_device:
                raise OptionError(f"--snapshot: the port raises inside its device call ({type(raised.exc).__name__}: "
                                  f"{raised.exc}): no host step is behind it, and a call that raises has no output to "
                                  "judge; rerun the check on that backend (docs/snapshot.md)") from None
            return k, raised
    raise OptionError("--snapshot: the check's stage raised, but the port run again on its references does not: "
                      "nothing to record (a nondeterministic failure?)")


def record_raises(checkpoint, settings, stage) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the target's fields beyond host.py's common ones, the host.* tensors but the embedding rows)."""
    refs = stage.references
    k, raised = find_raise(checkpoint, settings, refs)
    same = (refs.bf16 if settings.dtype == "bfloat16" else refs.fp32)[k].captures
    prompt = list(refs.fp32[k].prompt)
    if raised.step == "decode_step":
        token, position = int(raised.args_[0]), int(raised.args_[1])
        ids, positions = torch.tensor([token]), torch.tensor([position])
        ref = same["decode.embeddings"][position - len(prompt)][None]
    else:
        ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
        ref = same["embeddings"]
    tensors = {"host.ids": ids, "host.positions": positions, "host.ref": ref}
    fields = dict(point="exception inside the port", ratio=1.0, prompt=k, position=int(positions[0]),
                  start=int(positions[0]), length=positions.numel(), bucket=1, step_name=raised.step,
                  raised=f"{type(raised.exc).__name__}: {raised.exc}")
    return fields, {name: t.detach().clone().contiguous() for name, t in tensors.items()}


class HostCalls:
    """Stands where the backend stands: keeps each device call's (inputs_embeds, positions) and
    answers with one zero logit per row (the step's host code is what is replayed)."""

    name, last_row_only, returns_captures, reads_cache, host_ranks, tp = "host calls", False, True, False, False, 1

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reset(self) -> None:
        pass

    def forward(self, inputs_embeds, positions, capture=False, last=None, seq_ids=None, verify=False):
        self.calls.append((inputs_embeds.detach().clone(), positions.detach().clone()))
        return torch.zeros(1, positions.shape[1], 1), {}


def judge_raises(snap, engine, device: HostCalls, t):
    """The step again through the port's code (`engine`: the host side over `device`): (failure,
    agreement) as host.py's judges return them."""
    target = snap.target
    if target["step_name"] == "decode_step":
        engine.decode_step(int(t["host.ids"][0]), int(t["host.positions"][0]))
    else:
        engine.prefill(t["host.ids"])
    width = t["host.ref"].shape[-1]
    embedded = {int(p): row[:width] for embeds, positions in device.calls
                for p, row in zip(positions[0], embeds[0]) if int(p) >= 0}
    wanted = [int(p) for p in t["host.positions"]]
    missing = [p for p in wanted if p not in embedded]
    if missing:
        return f"the {target['step_name']} step passed the device no row for positions {missing[:4]}", ""
    got = torch.stack([embedded[p] for p in wanted]).float()
    differs = (got != t["host.ref"].float()).any(-1)
    if bool(differs.any()):
        return (f"the {target['step_name']} step no longer raises, but {int(differs.sum())} of {len(wanted)} rows it "
                f"passes the device are not bit-exact with the reference's lookup"), ""
    return None, (f"the {target['step_name']} step no longer raises ({target['raised']} when recorded); its "
                  f"{len(wanted)} rows bit-exact with the reference's lookup")
