"""The result of `check`: its run's settings and its stages, each a sealed
harness.judge.stage_result.StageResult in the order the parity run executed them (the fp32 and bf16
stages, harness.judge.results.ParityStage, then the extra ones). The verdict reads the one list
(stage_result.overall_verdict). Its JSON is `to_json` here; harness.report.formats renders that JSON
as text and Markdown."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.judge.results import ParityStage
from harness.judge.stage_result import StageResult, overall_verdict

PARITY_STAGES = ("fp32", "bf16")  # the stages judged point by point; the others are the "extra" stages


@dataclass
class CheckResult:
    backend: str
    tp: int
    dtype: str
    stages: list[StageResult] = field(default_factory=list)  # sealed, in run order
    run_seconds: dict[str, float] = field(default_factory=dict)  # the whole run: build, reference, total
    stage_seconds: dict[str, float] = field(default_factory=dict)  # wall time of each stage (parity.stages)

    def stage(self, name: str) -> StageResult | None:
        return next((s for s in self.stages if s.stage == name), None)

    @property
    def fp32(self) -> ParityStage | None:
        return self.stage("fp32")

    @property
    def bf16(self) -> ParityStage | None:
        return self.stage("bf16")

    def judged(self, name: str) -> ParityStage | None:
        """The parity stage a failure named `name` was judged in: the fp32 stage's for "fp32" (where it
        ran), else the bf16 stage's (the bit-exact layers and host steps read the bf16 observation)."""
        return self.fp32 if name == "fp32" and self.fp32 is not None else self.bf16

    @property
    def extra_stages(self) -> list[StageResult]:
        return [s for s in self.stages if s.stage not in PARITY_STAGES]

    @property
    def notes(self) -> list[str]:
        return [n for s in (self.bf16, self.fp32) if s is not None for n in s.notes]

    @property
    def seq_match(self) -> bool:
        return all(s.seq_match for s in (self.bf16 or self.fp32,) if s is not None)

    @property
    def passed(self) -> bool:
        """Every stage passes: every capture point of the fp32 and bf16 stages within its judge, every
        token mismatch accounted for (a near tie or a saturation tie), no exception inside the port,
        every extra stage's gates (stage_result.overall_verdict)."""
        return overall_verdict(self.stages).passed

    @property
    def failed_stages(self) -> list[str]:
        return overall_verdict(self.stages).failed_stages

    def failures(self) -> list[dict]:
        return overall_verdict(self.stages).failures

    def divergent(self) -> tuple[int, str] | None:
        return overall_verdict(self.stages).divergent

    @property
    def first_divergent_layer(self) -> int | None:
        found = self.divergent()
        return found[0] if found else None

    @property
    def first_divergent_component(self) -> str | None:
        found = self.divergent()
        return found[1] if found else None

    def to_json(self) -> dict:
        def d(p):
            return p.__dict__ if p is not None else None

        fp32 = self.fp32
        main = self.bf16 or fp32 or ParityStage(self.backend, self.tp, self.dtype)  # none ran: empty columns
        verdict = overall_verdict(self.stages)  # built once: the JSON writes it
        layer, component = verdict.divergent or (None, None)
        parity = [s for s in (fp32, self.bf16) if s is not None]
        return {"passed": verdict.passed, "seq_match": self.seq_match, "backend": self.backend,
                "tp": self.tp, "dtype": self.dtype, "first_divergent_layer": layer,
                "first_divergent_component": component,
                "local_layers": [v.to_json() for v in main.local] if main.local is not None else None,
                "near_tie_flips": main.near_ties, "real_divergences": main.divergences,
                "embeddings": d(main.embeddings), "embeddings_exact": main.embeddings_exact,
                "final_norm": d(main.final_norm), "logits": d(main.logits), "decode_logits": d(main.decode_logits),
                "layers": [main.layer_json(lr, fp32 if main is not fp32 else None) for lr in main.layers],
                "prompts": [p.to_json() for p in main.prompts],
                "notes": self.notes, "stages": {s.stage: s.stage_json() for s in parity},
                "failed_stages": verdict.failed_stages,
                "failed_stage": verdict.failed_stages[0] if verdict.failed_stages else None,
                "first_failure": verdict.failures[0] if verdict.failures else None,
                "seconds": dict({s.stage: s.seconds for s in parity}, run=self.run_seconds,
                                stages={k: v for k, v in self.stage_seconds.items() if k not in PARITY_STAGES}),
                "near_tie_calibration": asdict(main.calibration) if main.calibration else None,
                "port_error": next((s.port_error for s in (self.bf16, fp32) if s is not None and s.port_error), None),
                "routing": main.routing.to_json() if main.routing is not None else None,
                "extra_stages": {s.stage: s.to_json() for s in self.extra_stages}}
