"""The `gemma-parity` command line: `info` shows the resolved spec, the TP plan and the memory per
rank of the real configs; every bad input is refused with exit status 2, a message naming the
file or key and what to do, and nothing written. Broken checkpoints are private copies of the
cached tiny checkpoint, damaged one way each."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import FIXTURES_DIR
from harness.cli import EXIT_BAD_INPUT, EXIT_OK, main
from harness.inputs.spec import spec_from_config_dict
from harness.inputs.tiny import TINY_CONFIG
from harness.reference.golden_write import write_golden
from harness.reference.run import ReferenceResult

CONFIG_12B = FIXTURES_DIR / "configs" / "gemma-4-12b-it.json"
CONFIG_31B = FIXTURES_DIR / "configs" / "gemma-4-31b-it.json"
WEIGHTS = "model.safetensors"
TEXT = "model.language_model."


# ---- info -------------------------------------------------------------------------------------

def _info(tmp_path, config: Path, tp: int, capsys) -> tuple[dict, str]:
    out = tmp_path / "info.json"
    assert main(["info", "--config", str(config), "--tp", str(tp), "--json", str(out)]) == EXIT_OK
    return json.loads(out.read_text()), capsys.readouterr().out


def test_info_12b_tp2_plan(tmp_path, capsys):
    """48 layers; full layers 5, 11, ..., 47 put 8 query heads on 1 replicated KV head per rank
    (groups 8); sliding layers shard to 8 query and 4 KV heads per rank (groups 2)."""
    payload, text = _info(tmp_path, CONFIG_12B, 2, capsys)
    layers = payload["layers"]
    assert [layer["index"] for layer in layers] == list(range(48))
    assert [layer["index"] for layer in layers if layer["type"] == "full_attention"] == list(range(5, 48, 6))
    for layer in layers:
        full = layer["type"] == "full_attention"
        assert layer["head_dim"] == (512 if full else 256)
        assert (layer["q_heads"], layer["kv_heads"]) == ((16, 1) if full else (16, 8))
        assert layer["q_heads_per_rank"] == 8
        assert layer["kv_heads_per_rank"] == (1 if full else 4)
        assert layer["groups"] == (8 if full else 2)
        assert layer["kv_layout"] == ("replicate" if full else "shard")
    assert "48 layers" in text and "tp=2" in text


def _expected_bytes_per_rank_12b_tp2(kv_len: int = 256) -> int:
    """Device bytes on one rank at tp=2 in bf16, from the 12B config's numbers (norms, a few
    thousand parameters per layer, are left out: under 0.01%)."""
    t = json.loads(CONFIG_12B.read_text())["text_config"]
    h, inter, vocab, tp = t["hidden_size"], t["intermediate_size"], t["vocab_size"], 2
    q_per_rank = t["num_attention_heads"] // tp  # 16 / 2 = 8
    # sliding: q_proj + o_proj 2*3840*(8*256) + k_proj + v_proj 2*3840*(4*256) + gate/up/down 3*3840*15360/2
    #        = 15,728,640 + 7,864,320 + 88,473,600 = 112,066,560 parameters
    d = t["head_dim"]
    sliding = 2 * h * q_per_rank * d + 2 * h * (t["num_key_value_heads"] // tp) * d + 3 * h * inter // tp
    # full: q_proj + o_proj 2*3840*(8*512) + k_proj only (k = v) of the one replicated KV head 3840*512 + MLP
    #     = 31,457,280 + 1,966,080 + 88,473,600 = 121,896,960 parameters
    g = t["global_head_dim"]
    full = 2 * h * q_per_rank * g + h * t["num_global_key_value_heads"] * g + 3 * h * inter // tp
    n_full = t["layer_types"].count("full_attention")  # 8
    n_sliding = len(t["layer_types"]) - n_full  # 40
    lm_head = vocab * h // tp  # tied, split by vocab: 503,316,480
    # KV cache: k and v, 4 heads x 256 on sliding layers, 1 head x 512 on full layers, kv_len positions
    kv = kv_len * 2 * (n_sliding * (t["num_key_value_heads"] // tp) * d + n_full * 1 * g)  # 23,068,672
    # 40 * 112,066,560 + 8 * 121,896,960 + 503,316,480 + 23,068,672 = 5,984,223,232 values * 2 bytes
    return 2 * (n_sliding * sliding + n_full * full + lm_head + kv)  # ≈ 11.97e9


def test_info_12b_tp2_bytes_per_rank(tmp_path, capsys):
    """About 12 GB (11.15 GiB) per rank in bf16 (the published figure), within 1% of the figure derived
    here from the config, shown in GiB like every memory figure."""
    payload, text = _info(tmp_path, CONFIG_12B, 2, capsys)
    expected = _expected_bytes_per_rank_12b_tp2()
    assert abs(payload["bytes_per_rank"] - expected) / expected < 0.01, (payload["bytes_per_rank"], expected)
    assert 11.5e9 < payload["bytes_per_rank"] < 12.5e9
    assert f"{payload['bytes_per_rank'] / 2**30:.2f} GiB" in text


def test_info_sizes_in_units_that_fit_and_no_published_figure_for_another_model(tiny0_dir, capsys):
    """The tiny model's bytes per rank in KiB/MiB (never "0.00 GiB"), its inert parts said once, and no
    "floor / published" line (the published latency is the 12B's); the 12B keeps it. One unit for
    memory: binary (GiB, MiB, KiB) on every line, never GB beside GiB (rates stay GB/s)."""
    assert main(["info", "--checkpoint", str(tiny0_dir), "--perf"]) == EXIT_OK
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if line.startswith("bytes per rank"))
    assert "0.00 GiB" not in line and " GiB " not in line and ("MiB" in line or "KiB" in line), line
    assert not DECIMAL_SIZE.search(text), DECIMAL_SIZE.search(text)
    assert text.count("present but inert") == 1
    assert "published" not in text.replace("not published", "")
    assert main(["info", "--config", str(CONFIG_12B), "--perf"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "floor / published = " in text and "bytes per rank (bfloat16): 11.15 GiB" in text
    assert not DECIMAL_SIZE.search(text), DECIMAL_SIZE.search(text)


DECIMAL_SIZE = re.compile(r"\d (?:GB|MB|kB)(?!/s)|(?:weights|KV|host) (?:GB|MB)\b")


@pytest.mark.parametrize("n_bytes, shown", [(11.97e9, "11.15 GiB"), (46.14e6, "44.00 MiB"), (965_660, "943.03 KiB"),
                                             (786, "786 B"), (0, "0 B")])
def test_sizes_are_shown_in_the_unit_that_fits(n_bytes, shown):
    from harness.report.formats import size_text

    assert size_text(n_bytes) == shown

def test_info_31b_tp8_replicates_full_layer_kv(tmp_path, capsys):
    """The 31B-shaped config at tp=8: full layers' 4 KV heads are replicated (one per rank, 4 query
    heads each); sliding layers' 16 KV heads shard 2 per rank."""
    payload, _ = _info(tmp_path, CONFIG_31B, 8, capsys)
    full = [layer for layer in payload["layers"] if layer["type"] == "full_attention"]
    sliding = [layer for layer in payload["layers"] if layer["type"] == "sliding_attention"]
    assert full and sliding
    for layer in full:
        assert (layer["kv_heads"], layer["kv_layout"], layer["kv_heads_per_rank"]) == (4, "replicate", 1)
        assert (layer["q_heads_per_rank"], layer["groups"]) == (4, 4)
    for layer in sliding:
        assert (layer["kv_heads"], layer["kv_layout"], layer["kv_heads_per_rank"]) == (16, "shard", 2)


@pytest.mark.parametrize("config", [CONFIG_31B, FIXTURES_DIR / "configs" / "gemma-4-26b-a4b-it.json"])
def test_info_without_tp_plans_at_the_smallest_tp_that_fits(tmp_path, capsys, config):
    """Neither fits a NeuronCore per rank at the default tp=2: without --tp, info plans at the
    smallest TP whose core fit and chip memory plan both hold (a TP the commands then accept: 4 for the
    MoE, 8 for the 31B once the runtime's reserve is counted) and says so first; with --tp 2 it is still
    refused with the numbers and that TP."""
    from harness.inputs.spec import load_spec
    from harness.plan.instances import smallest_fitting_tp

    spec = load_spec(config)
    smallest = smallest_fitting_tp(spec)
    assert smallest in (4, 8)
    out = tmp_path / "info.json"
    assert main(["info", "--config", str(config), "--json", str(out)]) == EXIT_OK
    text = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["tp"] == smallest and payload["placement"]["fits"]
    assert payload["placement"]["smallest_fitting_tp"] == smallest
    assert text.splitlines()[0] == ("--tp not given: tp=2 (the default) does not fit one NeuronCore per rank; "
                                    f"planning at tp={smallest}, the smallest TP that fits")
    for below in (t for t in (4,) if t < smallest):  # a TP under it is refused by the commands' own check
        assert main(["info", "--config", str(config), "--tp", str(below)]) == EXIT_BAD_INPUT
        capsys.readouterr()
    assert main(["info", "--config", str(config), "--tp", "2"]) == EXIT_BAD_INPUT
    assert f"Use --tp {smallest} or more" in capsys.readouterr().err
    assert main(["info", "--config", str(CONFIG_12B)]) == EXIT_OK  # the 12B fits the default: no note
    assert "--tp not given" not in capsys.readouterr().out


# ---- bad input: exit 2, a message that helps, nothing written ---------------------------------

def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _refused(argv: list[str], capsys, root: Path, *fragments: str) -> str:
    """Run the CLI; assert exit 2, every fragment in stderr, and no file added under root."""
    before = _tree(root)
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert _tree(root) == before
    return err


@pytest.fixture
def ckpt_copy(tmp_path, tiny0_dir):
    """A private copy of the cached tiny checkpoint, to damage (the cache itself is never touched)."""
    return Path(shutil.copytree(tiny0_dir, tmp_path / "ckpt"))


def _edit_config(ckpt: Path, edit) -> None:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _rewrite_weights(ckpt: Path, edit) -> None:
    tensors = load_file(ckpt / WEIGHTS)
    edit(tensors)
    save_file(tensors, str(ckpt / WEIGHTS), metadata={"format": "pt"})


def _reference(ckpt: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["reference", "--checkpoint", str(ckpt), "--out", str(tmp_path / "golden"), *extra]


def test_missing_config_is_refused(ckpt_copy, tmp_path, capsys):
    """A checkpoint directory without config.json: named, with the two ways to supply one."""
    (ckpt_copy / "config.json").unlink()
    _refused(_reference(ckpt_copy, tmp_path), capsys, tmp_path, "config.json not found", "--config")


def test_wrong_model_type_is_refused(ckpt_copy, tmp_path, capsys):
    """A config of another model family: the file, the model_type found and the checkpoint to use."""
    _edit_config(ckpt_copy, lambda c: c.update(model_type="gemma3"))
    _refused(_reference(ckpt_copy, tmp_path), capsys, tmp_path, "config.json", "model_type is 'gemma3'",
             "Point the tool at a Gemma-4 checkpoint")


def test_shard_listed_in_index_but_missing_is_refused(ckpt_copy, tmp_path, capsys):
    """An index that maps one layer's keys to a shard that is not there (the weights sharded the
    way save_pretrained shards them: no model.safetensors, which transformers would load first)."""
    keys = load_file(ckpt_copy / WEIGHTS).keys()
    first, lost = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (ckpt_copy / WEIGHTS).rename(ckpt_copy / first)
    weight_map = {k: (lost if k.startswith(f"{TEXT}layers.11.") else first) for k in keys}
    (ckpt_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _refused(_reference(ckpt_copy, tmp_path), capsys, tmp_path, lost, "missing", "Download the missing shard")


def test_missing_key_is_refused(ckpt_copy, tmp_path, capsys):
    """A shard rewritten without one tensor the config implies: the key is named."""
    key = f"{TEXT}layers.3.mlp.up_proj.weight"
    _rewrite_weights(ckpt_copy, lambda t: t.pop(key))
    _refused(_reference(ckpt_copy, tmp_path), capsys, tmp_path, key, "is missing", "incomplete")


def test_shape_that_disagrees_with_config_is_refused(ckpt_copy, tmp_path, capsys):
    """config.json says intermediate_size 96; the stored MLP is 128 wide."""
    _edit_config(ckpt_copy, lambda c: c["text_config"].update(intermediate_size=96))
    _refused(_reference(ckpt_copy, tmp_path), capsys, tmp_path, WEIGHTS, f"{TEXT}layers.0.mlp.gate_proj.weight",
             "(128, 64)", "(96, 64)", "use the config the weights were saved with")


@pytest.mark.parametrize("key,value", [("hidden_size_per_layer_input", 16),
                                       ("use_bidirectional_attention", "all"), ("enable_moe_block", True)])
def test_unsupported_feature_is_refused_by_key(tmp_path, capsys, key, value):
    """Each feature the port lacks is named by its config key, with what to do instead."""
    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"][key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _refused(["info", "--config", str(path), "--json", str(tmp_path / "info.json")], capsys, tmp_path,
             str(path), f"unsupported config key {key}", "use a checkpoint without this feature")


def test_unified_kv_sharing_runs_and_its_bound_is_checked(tmp_path, capsys):
    """gemma4_unified has KV sharing (transformers 5.24 applies num_kv_shared_layers; issue 45 moved
    it out of the refused features): info plans the shared layers; a count that leaves no layer
    to compute keys and values is refused by its key."""
    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"]["num_kv_shared_layers"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["info", "--config", str(path)]) == EXIT_OK
    assert "KV sharing: layers 10-11 read the cache of layer(s)" in capsys.readouterr().out
    config["text_config"]["num_kv_shared_layers"] = 12
    path.write_text(json.dumps(config))
    _refused(["info", "--config", str(path), "--json", str(tmp_path / "info.json")], capsys, tmp_path,
             str(path), "num_kv_shared_layers=12", "must be below num_hidden_layers=12")


def test_pickle_checkpoint_is_refused_unread(tmp_path, tiny0_dir, capsys):
    """A directory with only pytorch_model.bin is refused by name, and the pickle is never loaded
    (loading this one would create a file)."""
    ckpt = tmp_path / "pickled"
    ckpt.mkdir()
    shutil.copy(tiny0_dir / "config.json", ckpt / "config.json")
    sentinel = tmp_path / "pickle-was-loaded"

    class Payload:
        def __reduce__(self):
            return open, (str(sentinel), "w")

    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    _refused(_reference(ckpt, tmp_path), capsys, tmp_path, "pytorch_model.bin", "refused", "safetensors")
    assert not sentinel.exists()


def test_truncated_shard_is_refused(ckpt_copy, tmp_path, capsys):
    """A shard cut in half: the file is named as truncated or corrupted, to be saved again."""
    shard = ckpt_copy / WEIGHTS
    os.truncate(shard, shard.stat().st_size // 2)
    _refused(_reference(ckpt_copy, tmp_path), capsys, tmp_path, str(shard), "truncated or corrupted")


# ---- goldens passed to check --------------------------------------------------------------------

def _placeholder_golden(out: Path, spec) -> Path:
    """A golden for `spec` whose tensors are never compared: every test using it is refused
    earlier (hash or spec) than the consistency check, which would refuse its missing captures."""
    def runs(dtype):
        return [ReferenceResult([1, 2, 3], dtype, {"logits": torch.zeros(3, spec.vocab_size)}, [],
                                torch.empty(0, spec.vocab_size))]
    return write_golden(out, spec, {"float32": runs("float32"), "bfloat16": runs("bfloat16")}, new_tokens=0)


def _check(ckpt: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["check", "--checkpoint", str(ckpt), "--json", str(tmp_path / "check.json"),
            "--report", str(tmp_path / "report"), *extra]


def test_corrupted_golden_is_refused_by_check(tmp_path, tiny0_ckpt, capsys):
    """One flipped byte in the golden's tensors: the file is named, to be regenerated."""
    golden = _placeholder_golden(tmp_path / "golden", tiny0_ckpt.spec)
    tensors = golden / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0x01
    tensors.write_bytes(bytes(data))
    _refused(_check(tiny0_ckpt.path, tmp_path, "--golden", str(golden)), capsys, tmp_path,
             str(tensors), "corrupted", "regenerate")


def test_golden_of_another_spec_is_refused_by_check(tmp_path, tiny0_ckpt, capsys):
    """A golden made for the tiny model with sliding_window 8 does not judge the tiny model."""
    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"]["sliding_window"] = 8
    other = spec_from_config_dict(config, "window8/config.json")
    golden = _placeholder_golden(tmp_path / "golden", other)
    _refused(_check(tiny0_ckpt.path, tmp_path, "--golden", str(golden)), capsys, tmp_path,
             other.spec_hash(), tiny0_ckpt.spec.spec_hash(), "regenerate it for this config")


# ---- prompts ------------------------------------------------------------------------------------

def _prompts_file(tmp_path: Path, prompts) -> Path:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    return path


@pytest.mark.parametrize("command", ["check", "reference"])
def test_empty_prompt_is_refused(tmp_path, tiny0_dir, capsys, command):
    """An empty prompt in the prompts file: the file and the prompt's index are named."""
    prompts = _prompts_file(tmp_path, [[5, 6], []])
    argv = (_check(tiny0_dir, tmp_path) if command == "check" else _reference(tiny0_dir, tmp_path))
    _refused(argv + ["--prompts", str(prompts)], capsys, tmp_path, str(prompts), "prompt 1 is empty",
             "give at least one token")


@pytest.mark.parametrize("command", ["check", "reference"])
@pytest.mark.parametrize("bad", [512, -3])
def test_token_outside_vocabulary_is_refused(tmp_path, tiny0_dir, capsys, command, bad):
    """The tiny vocabulary is [0, 512): the id and its position are named."""
    prompts = _prompts_file(tmp_path, [[5, 6, 7], [1, 2, bad, 4]])
    argv = (_check(tiny0_dir, tmp_path) if command == "check" else _reference(tiny0_dir, tmp_path))
    _refused(argv + ["--prompts", str(prompts)], capsys, tmp_path, f"prompt 1: token id {bad} at position 2",
             "outside the vocabulary [0, 512)", "check the prompts file")


# ---- NaN in a weight ------------------------------------------------------------------------------

NAN_KEY = f"{TEXT}layers.7.mlp.down_proj.weight"


@pytest.fixture
def nan_ckpt(ckpt_copy):
    def poison(tensors):
        tensors[NAN_KEY][3, 5] = float("nan")
    _rewrite_weights(ckpt_copy, poison)
    return ckpt_copy


def test_nan_weight_is_refused_by_check(nan_ckpt, tmp_path, capsys):
    """Building the port reads the weights (before the reference runs): NumericsError naming the
    shard and the key."""
    prompts = _prompts_file(tmp_path, [[5, 6, 7]])
    _refused(_check(nan_ckpt, tmp_path, "--prompts", str(prompts), "--new-tokens", "1"), capsys, tmp_path,
             str(nan_ckpt / WEIGHTS), NAN_KEY, "NaN or Inf")


def test_nan_weight_is_refused_by_streaming_reference(nan_ckpt, tmp_path, capsys):
    """The layer-at-a-time reference reads through the checkpoint and names the poisoned key."""
    prompts = _prompts_file(tmp_path, [[5, 6, 7]])
    _refused(_reference(nan_ckpt, tmp_path, "--stream", "--prompts", str(prompts)), capsys, tmp_path,
             NAN_KEY, "NaN or Inf")


def test_nan_weight_is_refused_by_reference(nan_ckpt, tmp_path, capsys):
    """The whole-model reference must not write a golden from NaN weights either."""
    prompts = _prompts_file(tmp_path, [[5, 6, 7]])
    _refused(_reference(nan_ckpt, tmp_path, "--new-tokens", "1", "--prompts", str(prompts)), capsys, tmp_path,
             NAN_KEY, "NaN or Inf")
