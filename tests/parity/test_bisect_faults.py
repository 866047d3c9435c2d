"""`gemma-parity bisect` against a golden of the original tiny checkpoint names the layer and the
component of a fault placed in one layer: weights perturbed in a copy of the checkpoint (the normal
use: a golden of yesterday's weights, today's checkpoint), port faults patched into one layer's
forward (a sliding-window mask off by one past the window's edge, NaN), and nothing at all for a
clean run or a perturbation inside bf16 noise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.cli import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK, main
from harness.inputs.checkpoint import Checkpoint
from harness.parity.bisect import run_bisect
from harness.parity.local import intra_op_threads_for
from harness.port import model as port_model
from harness.reference.golden import GOLDEN, read_golden
from harness.reference.golden_write import write_golden
from harness.reference.run import run_reference
from harness.report.formats import format_bisect
from tests.plot_extra import require_plot_extra

GOLDEN_NEW_TOKENS = 2  # enough for SEQ_MATCH; decode is the costly part of a reference run
# Noise of half the weights' own spread: a change of direction. Scaling a projection would show
# nothing here, because q_norm/k_norm/v_norm and the post-sublayer norms divide any scale out.
FAULT_NOISE = 0.5
# Half a bf16 rounding of the weights (2^-9 ~ 2e-3 relative): inside the envelope by construction.
BF16_NOISE = 1e-3


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory, tiny0_dir, tiny0_ckpt, default_prompts):
    """A golden of the original tiny checkpoint, written once per session."""
    with intra_op_threads_for(tiny0_ckpt.spec):  # the tiny model runs faster on one thread
        refs = run_reference(tiny0_dir, default_prompts, new_tokens=GOLDEN_NEW_TOKENS)
    out = tmp_path_factory.mktemp("bisect") / "golden"
    return write_golden(out, tiny0_ckpt.spec, refs, GOLDEN_NEW_TOKENS, tiny0_ckpt.file_hashes(), str(tiny0_dir))


@pytest.fixture(scope="session")
def golden(golden_dir, tiny0_ckpt):
    return read_golden(golden_dir, expected_spec=tiny0_ckpt.spec)


def perturbed_copy(src: Path, out: Path, layer: int | None, names: list[str], noise: float, seed: int = 0) -> Path:
    """A copy of the checkpoint with `names` (of one layer, or full keys when layer is None) given
    Gaussian noise of `noise` times each weight's standard deviation; every other tensor (and the
    config) byte-identical."""
    ckpt = Checkpoint.open(src)
    keys = [ckpt.layer_key(layer, n) if layer is not None else ckpt.prefix + n for n in names]
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(seed)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for key in keys:
            if key in tensors:
                w = tensors[key].float()
                tensors[key] = (w + noise * w.std() * torch.randn(w.shape, generator=gen)).to(tensors[key].dtype)
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
    return out


def _layer_fault(monkeypatch, layer: int, corrupt):
    """Patch DecoderLayer.forward so that layer `layer` (in the port's full run and alone) runs
    with `corrupt(x, positions, mask) -> (x, mask)` applied to its inputs."""
    original = port_model.DecoderLayer.forward

    def forward(self, x, cos, sin, positions, mask, captures=None, prefix=""):
        if prefix == f"layers.{layer}.":
            x, mask = corrupt(x, positions, mask)
        return original(self, x, cos, sin, positions, mask, captures, prefix)

    monkeypatch.setattr(port_model.DecoderLayer, "forward", forward)


WEIGHT_FAULTS = [
    pytest.param(0, ["self_attn.q_proj.weight"], "attention", id="q_proj-layer0"),
    pytest.param(3, ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp", id="gate_up-layer3"),
    # the slow lane: two more attention weights (q_proj above is the default lane's attention case)
    pytest.param(5, ["self_attn.k_proj.weight"], "attention", id="k_proj=value-full-layer5", marks=pytest.mark.slow),
    pytest.param(8, ["self_attn.v_proj.weight"], "attention", id="v_proj-layer8", marks=pytest.mark.slow),
]


# The diagnosis's points of the perturbed layer: (wrong, right). k_proj on a full layer is also its
# values (attention_k_eq_v); q_proj leaves keys and values right; gate/up leave the attention right.
DIAGNOSED = {0: ({"attn_residual"}, {"k", "v"}), 3: ({"mlp_residual"}, {"k", "v", "attn_residual"}),
             5: ({"k", "attn_residual"}, set()), 8: ({"v", "attn_residual"}, {"k"})}


@pytest.mark.parametrize("layer, names, component", WEIGHT_FAULTS)
def test_perturbed_layer_is_named_with_its_component(tmp_path, tiny0_dir, golden, layer, names, component):
    """Noise in one layer's attention or MLP weights: bisect reports exactly that layer and that
    component, and says the port computes the new weights right (the weights changed, not the code);
    its diagnosis names which of the layer's points are wrong (values, not keys, for v_proj)."""
    ckpt = Checkpoint.open(perturbed_copy(tiny0_dir, tmp_path / "ckpt", layer, names, FAULT_NOISE))
    result = run_bisect(ckpt, golden)
    assert result.first_divergent_layer == layer, [v.to_json()["local_ratio"] for v in result.layers]
    assert result.component == component
    assert result.cause == "weights"
    assert result.nonfinite is None
    diagnosis = result.diagnosis()
    parts = {p["part"]: p["passed"] for p in diagnosis["points"]}
    wrong, right = DIAGNOSED[layer]
    assert diagnosis["layer"] == layer and {"k", "attn_residual", "mlp_residual"} <= set(parts), parts
    assert all(parts[p] is False for p in wrong) and all(parts[p] is True for p in right), parts
    by_type = diagnosis["by_type"]
    assert sum(c["fail_alone"] for c in by_type.values()) == 1 and sum(c["layers"] for c in by_type.values()) == 12
    # the layers before it are clean on their own and in the port's run
    assert all(v.passed and v.cumulative_passed for v in result.layers[:layer])


def test_cli_names_full_layer_mlp_fault_and_writes_report(tmp_path, tiny0_dir, golden_dir, capsys):
    """Through `gemma-parity bisect --json --report`: exit 1, the JSON names layer 11 (a full
    layer) and mlp, and the report directory holds the Markdown table, the JSON and the plot."""
    ckpt = perturbed_copy(tiny0_dir, tmp_path / "ckpt", 11, ["mlp.down_proj.weight"], FAULT_NOISE)
    out_json, report = tmp_path / "bisect.json", tmp_path / "report"
    code = main(["bisect", "--golden", str(golden_dir), "--checkpoint", str(ckpt), "--json", str(out_json),
                 "--report", str(report)])
    printed = capsys.readouterr().out
    assert code == EXIT_FAIL
    payload = json.loads(out_json.read_text())
    assert payload["first_divergent_layer"] == 11 and payload["component"] == "mlp"
    assert payload["builds"] == 1 and payload["nonfinite"] is None
    layers = payload["layers"]
    assert [l["index"] for l in layers] == list(range(12))
    for key in ("index", "type", "cumulative_rel_l2", "local_rel_l2", "envelope_rel_l2", "local_envelope_rel_l2",
                "pass"):
        assert all(key in l for l in layers), key
    assert [l["pass"] for l in layers] == [True] * 11 + [False]
    assert layers[11]["local_rel_l2"] > 4 * layers[11]["local_envelope_rel_l2"]
    assert json.loads((report / "bisect.json").read_text())["first_divergent_layer"] == 11
    md = (report / "bisect.md").read_text()
    assert "first divergent layer: **11**" in md and "component: **mlp**" in md and "SEQ_MATCH" in md
    assert "| 11 | full |" in md and "FAIL (mlp)" in md
    assert "first divergent layer: 11" in printed
    require_plot_extra()
    assert (report / "bisect_errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the same clean bisect runs in the default lane in test_check_and_bisect_tell_the_same_story
def test_clean_checkpoint_reports_no_layer(tmp_path, tiny0_dir, golden_dir):
    """The checkpoint the golden was written from: no divergent layer, exit 0, SEQ_MATCH reported."""
    out_json = tmp_path / "bisect.json"
    code = main(["bisect", "--golden", str(golden_dir), "--checkpoint", str(tiny0_dir), "--json", str(out_json)])
    payload = json.loads(out_json.read_text())
    assert code == EXIT_OK, payload
    assert payload["first_divergent_layer"] is None and payload["component"] is None
    assert all(l["pass"] and l["cumulative_pass"] for l in payload["layers"])
    assert payload["seq_match"] is not None and payload["real_divergences"] == 0


def test_perturbation_within_bf16_noise_is_not_flagged(tmp_path, tiny0_dir, golden):
    """Noise of half a bf16 rounding in one layer's attention and MLP weights changes the fp32
    numbers but stays inside the bf16 envelope: no layer is reported."""
    names = ["self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight"]
    ckpt = Checkpoint.open(perturbed_copy(tiny0_dir, tmp_path / "ckpt", 4, names, BF16_NOISE))
    result = run_bisect(ckpt, golden)
    assert result.layers[4].checkpoint_drift_rel_l2 > 0  # the weights did change
    assert result.first_divergent_layer is None, result.layers[4].to_json()["local_ratio"]


def test_window_off_by_one_past_the_edge_is_named(monkeypatch, tiny0_ckpt, golden):
    """A sliding layer whose mask lets in one key too many (window 17 instead of 16) differs only
    at positions past the window's edge (prompts of 24 and 40 tokens): bisect names layer 8,
    attention, and says the port's layer (not the weights) is wrong."""
    window = tiny0_ckpt.spec.layers[8].window

    def widen(x, positions, mask):
        return x, port_model.attention_mask(positions, mask.shape[-1], window + 1, mask.dtype)

    _layer_fault(monkeypatch, 8, widen)
    result = run_bisect(tiny0_ckpt, golden)
    assert (result.first_divergent_layer, result.component, result.cause) == (8, "attention", "port")
    worst = next(p for p in result.to_json()["layers"][8]["local_points"] if not p["passed"])
    assert worst["worst_prompt_position"] >= window, worst


def test_nan_at_a_layer_output_is_reported_there(monkeypatch, tiny0_ckpt, golden):
    """NaN out of layer 6 (after its residual points were taken): bisect reports layer 6, the
    first non-finite point layers.6.output, and the cause nonfinite."""
    original = port_model.DecoderLayer.forward

    def forward(self, x, cos, sin, positions, mask, captures=None, prefix=""):
        out = original(self, x, cos, sin, positions, mask, captures, prefix)
        return out * float("nan") if prefix == "layers.6." else out

    monkeypatch.setattr(port_model.DecoderLayer, "forward", forward)
    result = run_bisect(tiny0_ckpt, golden)
    assert result.first_divergent_layer == 6 and result.cause == "nonfinite"
    assert result.nonfinite["layer"] == 6 and result.nonfinite["point"] == "layers.6.output"
    assert all(v.passed for v in result.layers[:6])


def test_nan_from_a_fully_masked_row_is_attention(monkeypatch, tiny0_ckpt, golden):
    """A mask row with no visible key makes softmax NaN in layer 2's attention: reported at layer
    2, component attention, first at its attention residual."""

    def mask_out_first_query(x, positions, mask):
        mask = mask.clone()
        mask[..., 0, :] = float("-inf")
        return x, mask

    _layer_fault(monkeypatch, 2, mask_out_first_query)
    result = run_bisect(tiny0_ckpt, golden)
    assert (result.first_divergent_layer, result.component, result.cause) == (2, "attention", "nonfinite")
    assert result.nonfinite["point"] == "layers.2.attn_residual"
    assert [0, 0] in result.nonfinite["positions"]  # the masked-out first query of each prompt


@pytest.mark.parametrize("name, point", [("embed_tokens.weight", "embeddings"),
                                         pytest.param("norm.weight", "final_norm", marks=pytest.mark.slow)])
def test_fault_outside_the_layers_is_not_blamed_on_a_layer(tmp_path, tiny0_dir, golden, name, point):
    """Noise in the embedding table (before layer 0) or the final norm (after layer 11): bisect
    names that point, no layer, and still fails."""
    ckpt = Checkpoint.open(perturbed_copy(tiny0_dir, tmp_path / "ckpt", None, [name], FAULT_NOISE))
    result = run_bisect(ckpt, golden)
    assert (result.first_divergent_point, result.first_divergent_layer, result.cause) == (point, None, point)
    assert not result.passed and format_bisect(result.to_json()).endswith("BISECT FAIL")
    assert all(v.passed for v in result.layers)  # every layer is fine on the golden's input


def test_golden_of_another_spec_is_bad_input(tmp_path, golden_dir, tiny0_dir, capsys):
    """A golden whose spec hash does not match the checkpoint's is refused with exit 2."""
    other = tmp_path / "golden"
    shutil.copytree(golden_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["spec_hash"] = "0" * 16
    # re-sealed, so that the spec check (not the manifest hash) is what refuses it
    manifest["golden_sha256"] = GOLDEN.seal(manifest, manifest["tensors_sha256"])
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert main(["bisect", "--golden", str(other), "--checkpoint", str(tiny0_dir)]) == EXIT_BAD_INPUT
    assert "golden was made for spec 0000000000000000" in capsys.readouterr().err


@pytest.mark.slow  # the default lane's bisects run it too (bisect's default); this one asserts its verdicts
def test_bisect_runs_the_fp32_stage(monkeypatch, tiny0_ckpt, golden_dir):
    """The exact GELU stays inside the bf16 envelope (bisect's layers all pass), but bisect also runs
    the fp32 structural stage, which names layer 0's MLP residual and fails the bisect."""
    from harness.parity.bisect import bisect_golden
    from tests.faults.catalog import exact_gelu

    exact_gelu(monkeypatch)
    result, payload = bisect_golden(tiny0_ckpt, golden_dir)
    assert all(v.passed for v in result.layers)
    assert not result.passed and payload["fp32_stage"]["passed"] is False
    assert payload["fp32_stage"]["failures"][0]["point"] == "layers.0.mlp_residual"
    assert payload["fp32_stage"]["first_divergent_layer"] == 0


def sliding_rope_theta_doubled(monkeypatch):
    """The sliding layers' rope theta doubled in the port (a config value read wrong)."""
    import dataclasses

    original = port_model.rope_inv_freq

    def inv_freq(layer, *device):
        if layer.type == "sliding_attention":
            layer = dataclasses.replace(layer, rope_theta=2 * layer.rope_theta)
        return original(layer, *device)

    monkeypatch.setattr(port_model, "rope_inv_freq", inv_freq)


AGREED = ("near_tie_flips", "real_divergences", "first_divergent_layer", "seq_match", "passed")


# The planted fault's agreement runs in the slow lane (CI runs it, about 9 CPU-seconds); the default
# lane keeps the clean agreement and bisect's own naming of planted faults (the tests above).
@pytest.mark.parametrize("fault", [pytest.param(None, id="clean"),
                                   pytest.param(sliding_rope_theta_doubled, id="sliding-rope-theta",
                                                marks=pytest.mark.slow)])
def test_check_and_bisect_tell_the_same_story(monkeypatch, tmp_path, tiny0_dir, golden_dir, fault):
    """`check --golden` and `bisect` on the same checkpoint and golden report the same near-tie and
    real-divergence counts, the same first divergent layer and the same verdict: clean, and with a
    planted bug (sliding layers' rope theta doubled: a real divergence, first at layer 0)."""
    if fault is not None:
        fault(monkeypatch)
    args = ["--checkpoint", str(tiny0_dir), "--golden", str(golden_dir)]
    codes = [main(["check", *args, "--json", str(tmp_path / "check.json")]),
             main(["bisect", *args, "--json", str(tmp_path / "bisect.json")])]
    check, bisect = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("check", "bisect"))
    assert {k: check[k] for k in AGREED} == {k: bisect[k] for k in AGREED}
    assert check["first_divergent_component"] == bisect["component"]
    if fault is None:  # the checkpoint the golden was written from
        assert codes == [EXIT_OK, EXIT_OK] and check["real_divergences"] == 0
        assert bisect["component"] is None and bisect["seq_match"] is not None
        assert all(layer["pass"] and layer["cumulative_pass"] for layer in bisect["layers"])
    else:
        assert codes == [EXIT_FAIL, EXIT_FAIL]
        assert check["real_divergences"] > 0 and check["first_divergent_layer"] == 0
        # the diagnosis in words: RoPE on the keys is wrong, the values are right; no full layer fails alone
        d = bisect["diagnosis"]
        parts = {p["part"]: p["passed"] for p in d["points"]}
        assert d["layer"] == 0 and parts["k"] is False and parts["v"] is True and parts["attn_residual"] is False
        assert d["by_type"]["full_attention"] == {"layers": 2, "fail_alone": 0}
        assert d["by_type"]["sliding_attention"]["fail_alone"] >= 5
        text = format_bisect(bisect)
        assert "keys wrong, values right: the error enters through the keys" in text
        assert "full 0 of 2 fail" in text
