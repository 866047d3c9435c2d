"""Prompt files: token-id lists, or strings when the checkpoint directory has a tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.base.errors import PromptError
from harness.inputs.prompts import load_prompts


def _word_tokenizer(directory):
    """A word-level tokenizer ("w5" -> 5) saved the way transformers saves any fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(1, 512)} | {"[UNK]": 0}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)


def test_string_prompts_use_the_checkpoints_tokenizer(tmp_path, tiny0_dir):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny0_dir, ckpt)
    _word_tokenizer(ckpt)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["w5 w17 w300", [7, 8]]))
    assert load_prompts(prompts, ckpt) == [[5, 17, 300], [7, 8]]


def test_string_prompt_without_tokenizer_is_refused(tmp_path, tiny0_dir):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hello"]))
    with pytest.raises(PromptError, match="no tokenizer"):
        load_prompts(prompts, tiny0_dir)


@pytest.mark.parametrize("content, fragment", [("[]", "non-empty"), ("{", "not valid JSON"),
                                               ('[[1, "x"]]', "integer token ids"), ("[[]]", "empty")])
def test_malformed_prompt_files_are_refused(tmp_path, content, fragment):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(content)
    with pytest.raises(PromptError, match=fragment):
        load_prompts(prompts)


@pytest.mark.parametrize("source, said, fix", [
    (None, "the default prompts file", "pass --prompts FILE with token ids below 300"),
    ("golden g", "golden g: ", "regenerate it for this model"),
    ("my.json", "my.json: ", "check the prompts file")])
def test_an_id_outside_the_vocabulary_names_where_the_prompts_came_from(source, said, fix):
    """With no --prompts the default prompts file is named as such (and the fix is --prompts, not
    "check the prompts file", which the user never gave); a golden's prompts say to regenerate it."""
    from harness.inputs.prompts import DEFAULT_PROMPTS, validate_prompt_ids
    from harness.inputs.spec import spec_from_config_dict
    from harness.inputs.tiny import TINY_CONFIG

    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"]["vocab_size"] = 300
    spec = spec_from_config_dict(config, "small-vocab")
    with pytest.raises(PromptError) as refused:
        validate_prompt_ids(spec, load_prompts(None), source)
    message = str(refused.value)
    assert said in message and fix in message and "outside the vocabulary [0, 300)" in message
    assert (str(DEFAULT_PROMPTS) in message) == (source is None)
    assert ("check the prompts file" in message) == (source == "my.json")
