"""Which device call a snapshot holds: the call behind a check's first failing layer point (a
prefill chunk, or the teacher-forced decode step of a decode point), or, on a passing run, the
prefill call behind its point with the largest ratio, as a control.

The judged stage is the one whose first failing layer comes first (the fp32 structural stage wins
when it names an earlier layer, as CheckResult.divergent decides); the point's worst row names the
prompt and position, and the engine's chunk plan names the call (the prefill chunk holding that
position: its graph, its rows, the KV rows it reads). When the bit-exact layer stage fails at a layer
before any failing layer point of those stages, the snapshot is of that layer alone at TP 1, one
chunk of a prompt's rows (harness/snapshot/bits.py picks the prompt).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.base.errors import OptionError
from harness.base.points import Point, locate
from harness.judge.bitwise import BitwiseStage
from harness.port.engine import chunk_plan
from harness.port.graphs import DECODE_TAG, PREFILL_TAG

BITS_STAGE = BitwiseStage.stage
HEAD_KINDS = ("final_norm", "logits")  # Point kinds of the head: after the last layer, inside the call
BITS_TAG = "layer_alone_tp1"  # not a device graph: the port's layer alone, bf16, TP 1, one chunk of n rows


@dataclass(frozen=True)
class Target:
    stage: str  # "bf16" (envelope) or "fp32" (structural): whose judge and references the call is judged by
    point: str  # the first failing (or, control, the largest-ratio) layer point
    layer: int
    ratio: float
    failing: bool  # False: a control snapshot of a passing run
    prompt: int
    position: int  # the worst row of the point, within its prompt
    start: int  # the call: its first position, real rows and bucket (graph)
    length: int
    bucket: int
    step: int | None = None  # a decode call: the teacher-forced step (its row of the decode points)
    host: str | None = None  # a host step's kind (harness.snapshot.host.KINDS): no device call behind it
    step_name: str | None = None  # a `raises` host step: the engine's step that raised (prefill, decode_step)
    raised: str | None = None  # and what it raised, when recorded

    @property
    def graph_tag(self) -> str:
        if self.host is not None:
            return f"host_{self.host}"  # not a device graph: the port's host code
        if self.stage == BITS_STAGE:
            return BITS_TAG
        return DECODE_TAG if self.step is not None else PREFILL_TAG.format(self.bucket)

    @property
    def prefix(self) -> str:
        """The prefix of the call's point names in a check's observation ("decode." for a decode step)."""
        return "" if self.step is None else "decode."

    def to_json(self) -> dict:
        return dict(asdict(self), graph_tag=self.graph_tag)


def measure(target: dict) -> str:
    """How far the target's point is out, as its stage measures it (a Target's to_json)."""
    if target["stage"] == BITS_STAGE:
        return f"{target['ratio']:.1%} of its elements depart bit for bit"
    if target.get("host") == "embed":
        return f"{target['ratio']:.0%} of the call's rows not bit-exact"
    if target.get("host") == "tokens":
        return "the reported sequence departs"
    if target.get("host") == "raises":
        return f"{target['step_name']} raised {target['raised']}"
    if target.get("host") == "probabilities":
        return f"ratio {target['ratio']:.3g}, limit 1"
    return f"{target['ratio']:.3g}x"


def _bits_failure(result) -> tuple[str, int] | None:
    """The bit-exact layer stage's first failing point and its layer (None: it passed, did not run, or
    failed by an exception, which has no layer behind it)."""
    stage = next((s for s in result.extra_stages if s.stage == BITS_STAGE), None)
    if stage is None or stage.error is not None:
        return None
    found = [f["point"] for g in stage.all_gates() if g.name == "bit_exact" for f in g.failures]
    return (found[0], Point.parse(found[0]).layer) if found else None


def _prefill_layer_points(stage) -> list:
    """The stage's prefill layer points (residual stream and family parts) in run order."""
    return [p for layer in stage.layers for p in layer.points if Point.parse(p.name).kind == "layer"]


def _decode_layer_points(stage) -> list:
    return [p for layer in stage.decode_layers for p in layer.points if Point.parse(p.name).kind == "layer"]


def _first_failing(stage):
    for points in (_prefill_layer_points(stage), _decode_layer_points(stage)):
        found = next((p for p in points if stage.point_failed(p)), None)
        if found is not None:
            return found
    return None


def _order(stage, point, fp32) -> tuple:
    parsed = Point.parse(point.name)
    return parsed.decode, parsed.layer, stage is fp32  # prefill first, then the earliest layer, bf16 on a tie


def choose_target(result, settings) -> Target:
    """The call to snapshot from a check's result (harness.judge.check_result.CheckResult: its bf16 stage, the fp32 stage beside it):
    the first failing layer point's; with none, the first failing head point's (final norm, logits:
    the same call's outputs, beside its last layer); with none, the host step behind the failure
    (harness.snapshot.host: the embedding lookup, the served probabilities, the reported tokens). An
    exception inside the port has neither: refused, naming where it was raised."""
    stages = [s for s in (result.fp32, result.bf16) if s is not None and s.observation is not None]
    failing = [(s, p) for s in stages for p in [_first_failing(s)] if p is not None]
    bits = _bits_failure(result)
    if bits is not None and all(Point.parse(p.name).layer > bits[1] for _, p in failing):
        rows = result.bf16.observation.ref32[0].captures["embeddings"].shape[0]  # bits.record_bits picks the prompt
        return Target(stage=BITS_STAGE, point=bits[0], layer=bits[1], ratio=1.0, failing=True, prompt=0, position=0,
                      start=0, length=rows, bucket=rows)
    if failing:
        stage, point = min(failing, key=lambda sp: _order(sp[0], sp[1], result.fp32))
    elif not result.passed:
        head = _failing_head(stages)
        if head is None:
            return _host_or_refuse(result, settings, stages)
        stage, point = head
    else:
        stage = result.bf16
        point = max(_prefill_layer_points(stage), key=lambda p: p.required_factor)
    refs, failed = stage.observation.ref32, not result.passed
    layer = Point.parse(point.name).layer
    layer = stage.layers[-1].index if layer is None else layer  # a head point: the call's last layer beside it
    if Point.parse(point.name).decode:  # rows: every prompt's teacher-forced steps after the first
        steps = [max(len(r.generated) - 1, 0) for r in refs]
        prompt, row = locate(point.worst_position, steps)
        return Target(stage=stage.stage, point=point.name, layer=layer, ratio=float(point.required_factor),
                      failing=True, prompt=prompt, position=len(refs[prompt].prompt) + row,
                      start=len(refs[prompt].prompt) + row, length=1, bucket=1, step=row)
    lengths = [len(r.prompt) for r in refs]
    prompt, position = locate(point.worst_position, lengths)
    start, length, bucket = next(c for c in chunk_plan(lengths[prompt], settings.buckets, settings.kv_len)
                                 if c[0] <= position < c[0] + c[1])
    return Target(stage=stage.stage, point=point.name, layer=layer, ratio=float(point.required_factor),
                  failing=failed, prompt=prompt, position=position, start=start, length=length, bucket=bucket)


def _failing_head(stages):
    """(stage, point) of the first failing head point (the final norm, the logits: the device call's
    outputs after its layers), prefill before decode, or None."""
    for decode in (False, True):
        for stage in stages:
            heads = [p for p in stage.all_points() if Point.parse(p.name).kind in HEAD_KINDS
                     and Point.parse(p.name).decode == decode]
            found = next((p for p in heads if stage.point_failed(p)), None)
            if found is not None:
                return stage, found
    return None


def _host_or_refuse(result, settings, stages) -> Target:
    """A failure no device call is behind: its host step (harness.snapshot.host), or, for an
    exception inside the port (no observation of the failing run to replay against), a refusal."""
    from harness.snapshot.host import host_target_fields

    found = host_target_fields(result, settings)
    if found is not None:
        return Target(**found)
    errors = [s.port_error for s in (result.bf16, result.fp32) if s is not None and s.port_error]
    if errors:
        raise OptionError(f"--snapshot: an exception inside the port ({errors[0]['type']} at {errors[0]['where']}) "
                          "in a stage that kept no references: nothing to replay it against; rerun the check "
                          "(docs/snapshot.md)")
    what = [f["point"] for s in stages for f in s.failures()][:3] or [", ".join(result.failed_stages)]
    raise OptionError(f"--snapshot: the check fails at {', '.join(map(str, what))}: no layer, head or host-step point "
                      "of its two stages, so no call is behind it to snapshot (docs/snapshot.md)")


def stage_settings(settings, stage: str):
    """The run settings the stage's port ran with (the fp32 stage: harness.parity.observe.fp32_settings)."""
    from harness.parity.observe import fp32_settings

    return fp32_settings(settings) if stage == "fp32" else settings
