"""`info --quantize int8`: bytes per rank, fit and decode floor of the int8 build beside the
unquantized one (harness/perf/quantized.py), checked against what the rank modules really hold."""

from __future__ import annotations

import json

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.perf.quantized import quantized_comparison
from harness.perf.roofline import instance_rates


def _held_bytes(engine) -> int:
    return sum(t.numel() * t.element_size() for t in engine.backend.ranks[0].state_dict().values())


def test_int8_bytes_per_rank_are_what_the_rank_module_holds(tiny0_ckpt):
    spec, tp = tiny0_ckpt.spec, 2
    c = quantized_comparison(spec, tp, "bfloat16", 32, instance_rates("inf2.8xlarge", tp))
    held = {name: _held_bytes(build_engine(tiny0_ckpt, RunSettings(tp=tp, kv_len=32, buckets=(16,), quantize=q)))
            for name, q in (("unquantized", None), ("int8", "int8"))}
    assert c["unquantized"]["weights_bytes_per_rank"] == held["unquantized"]
    assert c["int8"]["weights_bytes_per_rank"] == held["int8"]
    assert c["int8"]["decode_floor_ms"] < c["unquantized"]["decode_floor_ms"]


def test_info_quantize_int8_for_the_12b(tmp_path, capsys):
    from harness import FIXTURES_DIR
    from harness.cli import main

    out = tmp_path / "info.json"
    assert main(["info", "--config", str(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json"), "--quantize", "int8",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    q = json.loads(out.read_text())["quantization"]
    assert abs(q["unquantized"]["decode_floor_ms"] - 29.2) < 0.1  # the 23.9 GB per token at 820 GB/s
    assert 0.5 < q["floor_ratio"] < 0.56 and q["int8"]["fits"]  # lm_head stays bf16: a bit over half
    assert q["scale_bytes_per_rank"] > 0 and "the fp32 scales counted" in printed
    assert main(["info", "--config", str(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")]) == 0
    assert "--quantize int8 beside" not in capsys.readouterr().out  # only when asked


def test_every_fit_line_of_info_counts_the_int8_weights(tmp_path, capsys):
    """Under --quantize int8 the bytes-per-rank line, the HBM line and the roofline's weight bytes
    count the int8 weights (core_fit.rank_bytes), the figures the comparison block computes from
    the unquantized build less the savings; without --quantize they stay the unquantized ones."""
    from harness import FIXTURES_DIR
    from harness.cli import main

    config = str(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")
    runs = {}
    for name, extra in (("int8", ["--quantize", "int8"]), ("unquantized", [])):
        out = tmp_path / f"{name}.json"
        assert main(["info", "--config", config, "--perf", "--json", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text()), capsys.readouterr().out
    payload, printed = runs["int8"]
    q, tp, gib = payload["quantization"], payload["tp"], 2**30
    weights = q["int8"]["weights_bytes_per_rank"]
    assert weights < 0.6 * q["unquantized"]["weights_bytes_per_rank"]
    assert payload["memory"]["weights"] == weights and payload["bytes_per_rank"] == weights + payload["memory"]["kv_cache"]
    assert f"bytes per rank (bfloat16, int8 weights): {(weights + payload['memory']['kv_cache']) / gib:.2f} GiB" in printed
    for hbm in (payload["hbm"], payload["roofline"]["hbm"]):
        assert hbm["weights_bytes"] == tp * weights
    assert f"HBM: int8 weights {tp * weights / gib:.2f} GiB" in printed
    decode = next(row for row in payload["roofline"]["graphs"] if row["graph"] == "decode")
    assert abs(decode["memory_ms"] - q["int8"]["decode_memory_ms"]) < 1e-9
    plain, printed = runs["unquantized"]
    assert plain["memory"]["weights"] == q["unquantized"]["weights_bytes_per_rank"]
    assert plain["hbm"]["weights_bytes"] == tp * q["unquantized"]["weights_bytes_per_rank"]
    assert "int8 weights" not in printed
