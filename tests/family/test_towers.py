"""Family checkpoints as they ship (issue 45): Gemma4ForConditionalGeneration with a vision tower
(31B, 26B-A4B) or vision and audio towers (E2B, E4B), built by transformers' own class and saved with
save_pretrained (harness/inputs/tiny_towers.py). The loader reports each tower by name as present
and unused, checks the towers' shapes with the class of the checkpoint's model type, and `reference`,
`check`, `bisect`, `quality` and `info` run on them. One prompt, two tokens: the layout is under
test here, not the numerics (tests/family/test_family_port.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from harness.cli import EXIT_BAD_INPUT, EXIT_OK, main
from harness.inputs.checkpoint import Checkpoint
from harness.inputs.tiny_towers import TOWERS, tiny_tower_checkpoint

FAST = ["--new-tokens", "2", "--buckets", "16", "--kv-len", "32"]
MODULES = {"vision": "model.vision_tower.", "audio": "model.audio_tower."}


def _stored_keys(path) -> list[str]:
    keys = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            keys += list(f.keys())
    return keys


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps([[2, 17, 40, 93, 5, 250, 11, 64, 300, 8]]))
    return path


@pytest.fixture(scope="module")
def shipped_e2b(tmp_path_factory):
    """The E2B-shaped tower checkpoint as a user's save_pretrained leaves it: bfloat16, sharded
    behind an index, next to the processor's and the generation config's files."""
    import transformers

    out = tmp_path_factory.mktemp("shipped") / "e2b"
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(tiny_tower_checkpoint("e2b"),
                                                                        dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="200KB")
    (out / "chat_template.jinja").write_text("{{ messages }}")
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
    (out / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Gemma4ImageProcessor"}))
    assert (out / "model.safetensors.index.json").is_file() and (out / "generation_config.json").is_file()
    return out


@pytest.mark.parametrize("variant", sorted(TOWERS))
def test_towers_reported_by_name_with_their_counts(variant):
    path = tiny_tower_checkpoint(variant)
    stored = _stored_keys(path)
    text = Checkpoint.open(path).describe()
    for tower, prefix in MODULES.items():
        count = sum(k.startswith(prefix) for k in stored)
        assert (count > 0) == (tower in TOWERS[variant])
        line = f"{tower} tower: {count} tensors present, unused by the text port"
        assert (line in text) == (count > 0), text
    assert "no encoder towers" not in text and "no vision or audio encoder" not in text


def test_inert_shapes_are_checked_with_the_model_types_class(tmp_path):
    """A vision-tower tensor of the wrong shape is refused before model work, naming the key: only
    Gemma4ForConditionalGeneration (the gemma4 class) has that tensor to compare with."""
    src = tiny_tower_checkpoint("31b")
    Checkpoint.open(src).check_inert_parts()
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(bad / "model.safetensors")
    key = next(k for k in sorted(tensors) if k.startswith(MODULES["vision"]) and tensors[k].dim() == 2)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        Checkpoint.open(bad).check_inert_parts()
    assert main(["check", "--checkpoint", str(bad), "--new-tokens", "1"]) == EXIT_BAD_INPUT


# One checkpoint of each model type: the gemma4 one with both towers, sharded
# in bfloat16 as published (E2B), and the unified 12B's tiny checkpoint (its vision and audio
# embedders, as published: the 12B has no encoder towers; tests/unit/test_check_cli.py runs the same
# pair on it in the default lane). The other variants and the unified case here: the slow lane.
CASES = [pytest.param("31b", marks=pytest.mark.slow), pytest.param("26b-a4b", marks=pytest.mark.slow),
         "e2b", pytest.param("e4b", marks=pytest.mark.slow), pytest.param("unified", marks=pytest.mark.slow)]


def _case_path(case: str, request):
    from harness.inputs.tiny import tiny_checkpoint

    if case == "unified":
        return tiny_checkpoint(0)
    return request.getfixturevalue("shipped_e2b") if case == "e2b" else tiny_tower_checkpoint(case)


@pytest.mark.parametrize("case", CASES)
def test_reference_and_check_pass(case, prompts, tmp_path, capsys, request):
    path = _case_path(case, request)
    golden = tmp_path / "golden"
    assert main(["reference", "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(golden),
                 "--new-tokens", "2"]) == EXIT_OK
    assert main(["check", "--checkpoint", str(path), "--golden", str(golden), "--skip-served-build", *FAST[2:]]) == EXIT_OK
    out = capsys.readouterr().out
    assert "PARITY PASS" in out and ("vision embedder: 1 tensor present" in out)
    assert ("vision tower:" in out) == (case != "unified")


@pytest.mark.parametrize("case", sorted(TOWERS) + ["unified"])
def test_info_reports_the_parts(case, capsys, request):
    assert main(["info", "--checkpoint", str(_case_path(case, request))]) == EXIT_OK
    out = capsys.readouterr().out
    assert ("audio tower:" in out) == ("audio" in TOWERS.get(case, ())), out
    assert ("vision tower:" in out) == (case != "unified"), out


@pytest.mark.slow
def test_bisect_and_quality_run_on_towers(shipped_e2b, prompts, tmp_path):
    path = str(shipped_e2b)
    golden = tmp_path / "golden"
    assert main(["reference", "--checkpoint", path, "--prompts", str(prompts), "--out", str(golden),
                 "--new-tokens", "2"]) == EXIT_OK
    assert main(["bisect", "--checkpoint", path, "--golden", str(golden), *FAST[2:]]) == EXIT_OK
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(list(range(2, 42))))
    assert main(["quality", "--checkpoint", path, "--corpus", str(corpus), "--golden", str(tmp_path / "q"),
                 "--window", "16", *FAST[2:]]) == EXIT_OK
