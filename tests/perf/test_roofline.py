"""Roofline floors: the arithmetic checked against figures derived here by hand from the 12B table
of docs/design.md#the-model-facts-and-traps (not from harness.inputs.spec or harness.port.sharding), and `info --perf` printing them."""

from __future__ import annotations

import pytest

from harness import FIXTURES_DIR, perf
from harness.base.errors import HarnessInputError
from harness.cli import main as cli_main
from harness.inputs.spec import load_spec
from harness.perf import roofline

CONFIG_12B = FIXTURES_DIR / "configs" / "gemma-4-12b-it.json"

# docs/design.md#the-model-facts-and-traps: hidden 3840, intermediate 15360, vocab 262144 (tied),
# 48 layers = 40 sliding + 8 full;
# 16 query heads everywhere; sliding: 8 KV heads of 256 with k and v; full: 1 KV head of 512, k = v.
H, I, V, SLIDING, FULL, Q = 3840, 15360, 262144, 40, 8, 16
TP, BF16 = 2, 2
# Summed over both ranks. Sliding KV heads are sharded (4 + 4); the full layers' one KV head is
# replicated whole on both ranks (docs/design.md#the-port), so its k_proj counts twice.
SLIDING_MATS = 2 * H * Q * 256 + 2 * H * 8 * 256 + 3 * H * I
FULL_MATS = 2 * H * Q * 512 + TP * H * 512 + 3 * H * I
NORMS = TP * (SLIDING * (4 * H + 2 * 256 + 1) + FULL * (4 * H + 2 * 512 + 1) + H)
MATS = SLIDING * SLIDING_MATS + FULL * FULL_MATS + V * H
HBM = 820e9  # bytes/s per chip: the NKI architecture guide's 820 GB/s (decimal)
GIB = 2**30


def kv_bytes(tokens: int, kv_len: int) -> int:
    """Whole cache read (K and V) plus the written slots, both ranks."""
    per_slot = SLIDING * 8 * 256 + FULL * TP * 512  # sliding heads sharded, the full head on both ranks
    return 2 * BF16 * per_slot * (kv_len + tokens)


def test_weight_bytes_of_the_12b_at_tp2():
    assert MATS + NORMS == 11_923_848_800
    costs = roofline.graph_costs(load_spec(CONFIG_12B), TP, "bf16", 1, 256)
    assert costs["weight_bytes"] == BF16 * (MATS + NORMS) == 23_847_697_600


@pytest.mark.parametrize("tokens", [1, 64])
def test_floors_of_the_12b_at_tp2(tokens):
    spec = load_spec(CONFIG_12B)
    kv_len = 256
    attention = 2 * 2 * Q * tokens * kv_len * (SLIDING * 256 + FULL * 512)
    # the perf build: the layers on every token, lm_head and the logits only for the last real row
    flops = 2 * tokens * (MATS - V * H) + 2 * V * H + attention
    host = (tokens * H + V) * BF16
    rates = perf.instance_rates("inf2.8xlarge", TP, "bf16")
    row = roofline.graph_floors(spec, TP, "bf16", (64,), kv_len, rates)[0 if tokens == 64 else 1]
    assert row["graph"] == ("prefill[64]" if tokens == 64 else "decode")
    assert row["flops"] == flops and row["host_bytes"] == host
    assert row["kv_bytes"] == kv_bytes(tokens, kv_len)
    memory_ms = (BF16 * (MATS + NORMS) + kv_bytes(tokens, kv_len)) / HBM * 1e3
    assert row["memory_ms"] == pytest.approx(memory_ms, rel=1e-12)
    assert row["compute_ms"] == pytest.approx(flops / 190e12 * 1e3, rel=1e-12)
    assert row["host_ms"] == pytest.approx(host / 32e9 * 1e3, rel=1e-12)
    # Memory binds both graphs at these token counts: about 29.2 ms (23.85 GB at 820 GB/s)
    assert row["bound"] == "memory" and row["floor_ms"] == row["memory_ms"]
    assert 29.0 < row["floor_ms"] < 29.4


def test_efficiency_is_floor_over_measured():
    rates = roofline.Rates("test", 1e9, 1e12, None, "test")
    spec = load_spec(CONFIG_12B)
    block = perf.roofline_block(spec, TP, "bf16", (64,), 256, rates, {"prefill[64]": 50_000.0})
    prefill, decode = block["graphs"]
    assert prefill["host_ms"] is None and prefill["floor_ms"] == max(prefill["memory_ms"], prefill["compute_ms"])
    assert prefill["efficiency"] == pytest.approx(prefill["floor_ms"] / 50_000.0)
    assert decode["measured_ms"] is None and decode["efficiency"] is None


def test_instance_table_refuses_what_it_cannot_place():
    with pytest.raises(HarnessInputError, match="unknown instance type"):
        perf.instance_rates("inf1.xlarge", 2)
    with pytest.raises(HarnessInputError, match="tp=4 needs 2 Inferentia2 chips; inf2.8xlarge has 1"):
        perf.instance_rates("inf2.8xlarge", 4)
    big = perf.instance_rates("inf2.48xlarge", 8, "fp32")
    assert (big.memory_bytes_per_s, big.flops_per_s) == (4 * HBM, 4 * 47.5e12)


def test_info_perf_prints_the_12b_floors_without_running_anything(capsys, tmp_path):
    out_json = tmp_path / "info.json"
    assert cli_main(["info", "--config", str(CONFIG_12B), "--tp", "2", "--perf", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    floor = (BF16 * (MATS + NORMS) + kv_bytes(64, 256)) / HBM * 1e3
    line = next(line for line in out.splitlines() if line.startswith("prefill[64]"))
    assert f"{floor:.3f}" in line and "memory" in line
    assert next(line for line in out.splitlines() if line.startswith("decode"))
    assert f"published: prefill[64] 101 ms; floor / published = {100 * floor / 101:.1f}%" in out
    assert "memory 820.0 GB/s" in out and "NKI architecture guide" in out
    needed = (BF16 * (MATS + NORMS) + 2 * BF16 * (SLIDING * 8 * 256 + FULL * TP * 512) * 256) / GIB
    assert f"= {needed:.2f} GiB of 32 GiB: fits" in out


def test_one_core_gets_half_a_chip():
    """TP=1 runs on one NeuronCore: half the chip's bandwidth and compute, so twice the floor."""
    spec = load_spec(CONFIG_12B)
    one, two = perf.instance_rates("inf2.8xlarge", 1), perf.instance_rates("inf2.8xlarge", 2)
    assert (one.memory_bytes_per_s, one.flops_per_s) == (HBM / 2, 190e12 / 2)
    assert (two.memory_bytes_per_s, two.flops_per_s) == (HBM, 190e12)
    decode1 = roofline.graph_floors(spec, 1, "bf16", (64,), 256, one)[1]
    assert decode1["memory_ms"] == pytest.approx((decode1["weight_bytes"] + decode1["kv_bytes"]) / (HBM / 2) * 1e3)
    assert perf.instance_rates("inf2.48xlarge", 3).memory_bytes_per_s == 1.5 * HBM  # three cores' share


def test_hbm_fit_of_weights_and_kv():
    spec = load_spec(CONFIG_12B)
    fit = roofline.hbm_fit(spec, TP, "bf16", 256)
    assert fit["weights_bytes"] == BF16 * (MATS + NORMS) and fit["capacity_bytes"] == 32 * GIB and fit["fits"]
    assert not roofline.hbm_fit(spec, 1, "bf16", 256)["fits"]  # 22 GiB on one core's 16 GiB
    long = roofline.hbm_fit(spec, TP, "bf16", 262144)  # a long KV cache no longer fits
    assert long["kv_bytes"] == 2 * BF16 * (SLIDING * 8 * 256 + FULL * TP * 512) * 262144 and not long["fits"]
    assert "DOES NOT FIT" in roofline.render_hbm_fit(long)


def test_unknown_instances_are_refused_or_given_their_rates(tmp_path, capsys, monkeypatch):
    assert cli_main(["info", "--config", str(CONFIG_12B), "--perf", "--instance", "inf3.xlarge"]) == 2
    assert "--instance-rates FILE" in capsys.readouterr().err
    rates = tmp_path / "rates.json"
    rates.write_text('{"cores": 2, "chips": 1, "hbm_bytes": 34359738368, "hbm_bytes_per_s": 1.64e12, '
                     '"bf16_flops_per_s": 380e12, "fp32_flops_per_s": 95e12}')
    assert cli_main(["info", "--config", str(CONFIG_12B), "--perf", "--instance", "inf3.xlarge",
                     "--instance-rates", str(rates)]) == 0
    assert "memory 1640.0 GB/s" in capsys.readouterr().out
    rates.write_text('{"cores": 2, "chips": 1}')
    assert cli_main(["info", "--config", str(CONFIG_12B), "--perf", "--instance-rates", str(rates)]) == 2
    assert "hbm_bytes, hbm_bytes_per_s" in capsys.readouterr().err
    with pytest.raises(HarnessInputError, match="GEMMA_PARITY_INSTANCE_RATES"):
        roofline.neuron_instance_rates("inf3.xlarge", 2, "bf16", {})
    assert roofline.neuron_instance_rates(None, 2, "bf16", {}).name.startswith("inf2.8xlarge")
