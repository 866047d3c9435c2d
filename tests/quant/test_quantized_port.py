"""int8 weight storage in the port (docs/quantization.md): the scheme, the sharding of its scales,
what each rank holds, and the structural check against the quantized model on the cpu backend."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.inputs.quantize import INT8, QUANTIZED, Scheme, dequantize, quantize_weight, scale_name
from harness.parity.check import check_port
from harness.port.rank_merge import merge_layer_shards
from harness.port.sharding import plan_model, rank_state_dicts, shard_layer
from tests.quant.conftest import QUICK


def test_per_output_channel_symmetric_codes_and_scales():
    torch.manual_seed(1)
    w = torch.randn(6, 10) * torch.arange(1, 7)[:, None]
    w[3] = 0.0
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (6, 1)
    nonzero = [r for r in range(6) if r != 3]
    assert torch.equal(s[nonzero, 0], w[nonzero].abs().amax(1) / 127)  # one scale per output row
    assert torch.equal(q[nonzero].abs().amax(1), torch.full((5,), 127, dtype=torch.int8))  # symmetric, full range
    assert torch.equal(q[3], torch.zeros(10, dtype=torch.int8)) and s[3, 0] == 1.0
    err = (dequantize(q, s, torch.float32) - w).abs()
    assert (err <= s / 2 + 1e-6).all()  # round to nearest: at most half a step
    trunc, _ = quantize_weight(w, Scheme(rounding="truncate"))
    assert not torch.equal(trunc, q)
    tensor, ts = quantize_weight(w, Scheme(granularity="tensor"))
    assert torch.equal(ts, torch.full_like(ts, w.abs().max().item() / 127))


def test_dequantize_casts_once_to_the_activation_dtype():
    q = torch.tensor([[127, -3]], dtype=torch.int8)
    s = torch.tensor([[0.01234567]])
    assert torch.equal(dequantize(q, s, torch.bfloat16), (q.float() * s).to(torch.bfloat16))
    assert dequantize(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_scales_shard_with_their_rows_at_tp2(tiny0_ckpt):
    """Column-parallel scales split with the rows (each rank's are its rows' own), row-parallel ones
    replicated (whole output rows on every rank); merging the shards gives the whole layer back."""
    from harness.inputs.quantize import quantize_layer

    for plan in plan_model(tiny0_ckpt.spec, 2)[:6]:
        whole = quantize_layer(tiny0_ckpt.layer_weights(plan.index))
        shards = [shard_layer(whole, plan, rank) for rank in range(2)]
        for shard in shards:
            for name in QUANTIZED:
                if name not in shard:
                    continue
                q, s = shard[name], shard[scale_name(name)]
                assert q.dtype == torch.int8 and s.shape == (q.shape[0], 1)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    assert torch.equal(s, whole[scale_name(name)])  # row-parallel: replicated
        for name in ("self_attn.q_proj.weight", "mlp.gate_proj.weight"):
            joined = torch.cat([sh[scale_name(name)] for sh in shards])
            assert torch.equal(joined, whole[scale_name(name)])  # column-parallel: split in rank order
        merged = merge_layer_shards(shards, plan)
        assert all(torch.equal(merged[n], whole[n]) for n in whole)


@pytest.mark.slow  # default-lane sibling: tests/quant/test_quantized_info.py (the rank module's bytes, to the byte)
def test_each_rank_holds_int8_weights_and_fp32_scales_and_keeps_the_rest(tiny0_ckpt):
    engine = build_engine(tiny0_ckpt, RunSettings(tp=2, quantize="int8", **QUICK))
    for module in engine.backend.ranks:
        state = module.state_dict()
        for i in range(tiny0_ckpt.spec.num_layers):
            for name in QUANTIZED:
                key = f"layers.{i}.{name}"
                if key in state:
                    assert state[key].dtype == torch.int8, key
                    assert state[f"layers.{i}.{scale_name(name)}"].dtype == torch.float32
        assert state["lm_head.weight"].dtype == torch.bfloat16  # NxD Inference keeps lm_head
        assert state["layers.0.input_layernorm.weight"].dtype == torch.bfloat16


def test_unquantized_state_dicts_are_unchanged(tiny0_ckpt):
    """The bf16 path: no scales, the checkpoint's weights in the run dtype, as before."""
    plain = rank_state_dicts(tiny0_ckpt, 2, torch.bfloat16)
    assert not any(k.endswith(".scale") for k in plain[0])
    w = tiny0_ckpt.layer_weights(0, torch.bfloat16)["self_attn.q_proj.weight"]
    assert torch.equal(torch.cat([plain[0]["layers.0.self_attn.q_proj.weight"],
                                  plain[1]["layers.0.self_attn.q_proj.weight"]]), w)


def test_quantized_reference_holds_the_dequantized_weights(tiny0_ckpt, int8_ckpt):
    assert int8_ckpt.unquantized is tiny0_ckpt and int8_ckpt.quantization == "int8"
    stored, ref = tiny0_ckpt.layer_weights(2), int8_ckpt.layer_weights(2)
    for name, w in stored.items():
        want = dequantize(*quantize_weight(w, INT8), torch.float32) if name in QUANTIZED else w
        assert torch.equal(ref[name], want), name
    assert torch.equal(int8_ckpt.lm_head_weight(), tiny0_ckpt.lm_head_weight())


def test_quantized_port_passes_the_structural_check(int8_ckpt, int8_reference):
    """Both stages (fp32 structural, bf16 envelope) against the quantized model itself, at TP 2 with
    the local verdicts (every model, backend and TP through the command: test_quantized_matrix.py)."""
    engine = build_engine(int8_ckpt, RunSettings(tp=2, quantize="int8", **QUICK))
    result = check_port(int8_ckpt, engine, int8_reference["float32"], int8_reference["bfloat16"], local=True)
    assert result.passed and result.fp32 is not None and result.fp32.passed
    assert result.bf16.divergences == 0


@pytest.mark.slow  # default-lane sibling: tests/quant/test_quant_faults.py (zero-point fails the same stage)
def test_unquantized_port_fails_the_quantized_models_fp32_stage(tiny0_ckpt, int8_ckpt, int8_reference):
    """Control: the judge sees the quantization (an unquantized port is not the quantized model)."""
    from harness.parity.check import structural_stage

    result = structural_stage(tiny0_ckpt, (int8_reference["float32"], int8_reference["bfloat16"]),
                              RunSettings(tp=1, **QUICK))
    assert not result.passed


@pytest.mark.slow  # reference and two bisects through the CLI (~20 CPU-seconds); default-lane sibling: test_quantized_port_passes_the_structural_check
def test_reference_and_bisect_with_quantize(tmp_path):
    """`reference --quantize int8` writes the quantized model's golden; `bisect --quantize int8`
    passes against it and the unquantized port does not."""
    import json

    from harness.cli import main
    from tests.quant.conftest import SHORT_PROMPTS

    prompts, golden = tmp_path / "prompts.json", tmp_path / "golden"
    prompts.write_text(json.dumps(SHORT_PROMPTS))
    assert main(["reference", "--model", "tiny", "--quantize", "int8", "--prompts", str(prompts), "--new-tokens", "3",
                 "--out", str(golden)]) == 0
    common = ["bisect", "--model", "tiny", "--golden", str(golden), "--buckets", "16", "--kv-len", "32"]
    assert main([*common, "--quantize", "int8"]) == 0
    assert main(common) == 1
