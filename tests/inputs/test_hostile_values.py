"""Systematically hostile values in every field of every input format: a config's keys, a prompts
file's entries, a golden manifest's fields (re-sealed, so only the content checks stand between it
and the port) and a perf result's fields. Each value is either accepted or refused as bad input
(HarnessInputError: exit 2); any other exception would be reported as an internal error (exit 70)
and fails here."""

from __future__ import annotations

import copy
import json
import shutil
import warnings

import pytest

from harness.base.errors import HarnessInputError
from harness.inputs.tiny import TINY_CONFIG
from tests.inputs.scenarios import perf_result, rehash_golden, small_golden

HOSTILE = [None, -1, 0, "x", "", [], {}, True, 1e30, 2 ** 70, float("nan"), float("inf"), [1], {"a": 1}, [[]],
           [None], ["x"], [True]]


def _accepted_or_refused(fn) -> str:
    try:
        fn()
    except HarnessInputError:
        return "refused"
    return "accepted"


def _config_variants():
    base = json.loads(TINY_CONFIG.read_text())
    for key in sorted(base["text_config"]):
        for value in HOSTILE:
            cfg = copy.deepcopy(base)
            cfg["text_config"][key] = value
            yield f"text_config.{key}={value!r}", cfg
    for kind in ("sliding_attention", "full_attention"):
        for key in ("rope_type", "rope_theta", "partial_rotary_factor"):
            for value in HOSTILE:
                cfg = copy.deepcopy(base)
                cfg["text_config"]["rope_parameters"][kind][key] = value
                yield f"rope_parameters.{kind}.{key}={value!r}", cfg
    for key in ("model_type", "text_config", "image_token_id", "tie_word_embeddings", "vision_config"):
        for value in HOSTILE:
            cfg = copy.deepcopy(base)
            cfg[key] = value
            yield f"{key}={value!r}", cfg


def test_every_hostile_config_value_is_accepted_or_refused_as_bad_input():
    from harness.inputs.spec import spec_from_config_dict

    outcomes = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, cfg in _config_variants():
            outcomes[name] = _accepted_or_refused(lambda: spec_from_config_dict(cfg, "hostile").spec_hash())
    assert len(outcomes) > 500
    # the ones the issue names must be refused, not accepted
    for name in ("text_config.num_attention_heads=0", "text_config.sliding_window=0", "text_config.hidden_size=True",
                 "text_config.vocab_size=nan", "rope_parameters.full_attention.rope_theta=None"):
        assert outcomes[name] == "refused", name


@pytest.mark.parametrize("content", [json.dumps(v) for v in HOSTILE] + [
    json.dumps([v]) for v in HOSTILE] + [json.dumps([[1, v]]) for v in HOSTILE] + ["", "[", "\x00", "[[1]] junk"])
def test_every_hostile_prompts_file_is_accepted_or_refused_as_bad_input(tmp_path, tiny0_ckpt, content):
    from harness.inputs.prompts import load_prompts, validate_prompt_fit, validate_prompt_ids

    path = tmp_path / "prompts.json"
    path.write_text(content)

    def load():
        prompts = load_prompts(path, tiny0_ckpt.path)
        validate_prompt_ids(tiny0_ckpt.spec, prompts, path)
        validate_prompt_fit(prompts, 8, path, (64,), 256, tiny0_ckpt.spec.max_positions)
        assert all(type(t) is int for p in prompts for t in p)

    _accepted_or_refused(load)


@pytest.fixture(scope="module")
def sealed_golden(tmp_path_factory, tiny0_ckpt):
    return small_golden(tmp_path_factory.mktemp("hostile") / "golden", tiny0_ckpt)


MANIFEST_FIELDS = ["prompts", "new_tokens", "results", "num_layers", "spec_hash", "format_version", "checkpoint"]


@pytest.mark.parametrize("field", MANIFEST_FIELDS)
def test_every_hostile_manifest_value_is_refused_as_bad_input(tmp_path, sealed_golden, tiny0_ckpt, field):
    """A re-sealed manifest whose field holds a hostile value: read_golden accepts it only when the
    value is harmless (provenance), and never raises anything but bad input."""
    from harness.reference.golden import read_golden, same_weights

    accepted = []
    for k, value in enumerate(HOSTILE):
        golden = shutil.copytree(sealed_golden, tmp_path / f"g{k}")
        rehash_golden(golden, edit_manifest=lambda m: m.__setitem__(field, value))
        if _accepted_or_refused(lambda: read_golden(golden, expected_spec=tiny0_ckpt.spec)) == "accepted":
            accepted.append(value)
            assert same_weights(read_golden(golden), tiny0_ckpt) in (None, False)
    # only the provenance record may be anything (then whether the weights match is unknown)
    assert accepted == ([] if field != "checkpoint" else HOSTILE), (field, accepted)


PERF_FIELDS = ["metrics", "prefill_ms_by_bucket", "prefill_bucket", "created", "machine", "tp", "spec_hash",
               "backend", "dtype", "format", "git_commit", "settings", "summary"]


@pytest.mark.parametrize("field", PERF_FIELDS)
def test_every_hostile_perf_field_is_accepted_or_refused_as_bad_input(tmp_path, capsys, field):
    """perf compare (two files, and a history) with a hostile field: exit 0/1 or 2, never an
    internal error."""
    from harness.cli import main

    base = tmp_path / "base.json"
    base.write_text(json.dumps(perf_result()))
    codes = set()
    for k, value in enumerate(HOSTILE):
        cur = tmp_path / f"cur{k}.json"
        cur.write_text(json.dumps({**perf_result(), field: value}))
        codes.add(main(["perf", "compare", "--baseline", str(base), "--current", str(cur), "--allow-mismatch"]))
        history = tmp_path / f"h{k}"
        history.mkdir()
        shutil.copy(base, history / "a.json")
        shutil.copy(cur, history / "b.json")
        codes.add(main(["perf", "compare", "--history", str(history)]))
    assert codes <= {0, 1, 2}, (field, codes, capsys.readouterr().err[-2000:])
    # fields read as numbers, dates or sample lists refuse hostile values; labels compared only for
    # equality (machine, spec, backend, dtype, commit) may hold anything
    assert 2 in codes or field in ("settings", "summary", "git_commit", "machine", "spec_hash", "backend", "dtype")
