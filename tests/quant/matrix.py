"""`check --quantize int8` through the command itself (harness.cli.main: validation, the quantized
model's checkpoint, both stages, the report) on the tiny 12B and each family variant, against the
quantized model's golden written once per model by `reference --quantize int8`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.family.shared import VARIANTS
from tests.quant.conftest import NEW_TOKENS, QUICK, SHORT_PROMPTS

MODELS = ("tiny", *(f"tiny-{name}" for name in VARIANTS))  # the tiny 12B and every family variant


def write_golden(model: str, where: Path) -> Path:
    """The quantized model's golden of SHORT_PROMPTS (`reference --model M --quantize int8`)."""
    from harness.cli import main

    where.mkdir(parents=True, exist_ok=True)
    prompts, golden = where / "prompts.json", where / "golden"
    prompts.write_text(json.dumps(SHORT_PROMPTS))
    assert main(["reference", "--model", model, "--quantize", "int8", "--prompts", str(prompts),
                 "--new-tokens", str(NEW_TOKENS), "--out", str(golden)]) == 0
    return golden


def check_int8(model: str, backend: str, tp: int, golden: Path, out: Path) -> tuple[int, dict]:
    """(exit status, --json payload) of `check --model M --backend B --tp T --quantize int8 --golden G`
    at the suite's quick settings, one prompt at a time, no served build."""
    from harness.cli import main

    rc = main(["check", "--model", model, "--backend", backend, "--tp", str(tp), "--quantize", "int8",
               "--golden", str(golden), "--buckets", *map(str, QUICK["buckets"]), "--kv-len", str(QUICK["kv_len"]),
               "--batch", "1", "--skip-served-build", "--json", str(out)])
    return rc, json.loads(out.read_text())


def assert_passes(rc: int, payload: dict, backend: str, tp: int) -> None:
    """Both stages passed on `backend` at `tp` with int8 weights; the fp32 stage's tokens are the
    quantized model's (the bf16 stage's may flip at a near tie, which its judge allows)."""
    run = payload["provenance"]["settings"]["run"]
    assert (run["quantize"], run["backend"], run["tp"]) == ("int8", backend, tp)
    assert rc == 0 and payload["passed"], payload["first_failure"]
    fp32 = payload["stages"]["fp32"]
    assert fp32["passed"] and fp32["seq_match"] and payload["stages"]["bf16"]["passed"]
