"""Hostile inputs on `quality` (its own golden files, the corpus, the report directory) and the other
surfaces issue 31 lists (perf files beside --markdown, long context, family configs, doctor's
inputs), table-driven like test_bad_inputs.py: each case damages a private copy, runs the command
in-process, and asserts exit 2 with a message naming the file and the fix, no traceback, no model
work before the refusal (counted: tests/model_work.py), and nothing on disk changed."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.inputs.scenarios import (TEXT, copy_checkpoint, edit_config, perf_result, rewrite_weights,
                                    run_inprocess, snapshot, write_json)
from tests.model_work import ModelWork

WINDOW, WINDOWS_PER_PART, SHARDS = 16, 2, 2
CORPUS_IDS = 64  # 4 windows: 2 shards of one part each


@dataclass
class Ctx:
    tmp: Path
    tiny: Path
    golden_src: Path
    corpus_src: Path

    def golden(self) -> Path:
        return Path(shutil.copytree(self.golden_src, self.tmp / "golden"))

    def corpus(self) -> Path:
        return Path(shutil.copy(self.corpus_src, self.tmp / "corpus.json"))

    def argv(self, golden: Path | None = None, corpus: Path | None = None, *extra) -> list:
        return ["quality", "--checkpoint", self.tiny, "--corpus", corpus or self.corpus(),
                "--golden", golden or self.golden(), *extra]


CASES: list[tuple[str, Callable[[Ctx], list], tuple[str, ...]]] = []


def case(id: str, *fragments: str):
    def register(setup):
        CASES.append((id, setup, fragments))
        return setup
    return register


# ---- the golden's own files ---------------------------------------------------------------------

SETTINGS = "quality-golden.json"
SEAL = "shard-000-of-002/complete.json"
PART = "shard-000-of-002/part-00000.safetensors"


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(edit(data)))


def with_settings(c: Ctx, edit) -> list:
    g = c.golden()
    edit_json(g / SETTINGS, edit)
    return c.argv(g)


def with_raw(c: Ctx, name: str, text: str) -> list:
    g = c.golden()
    (g / name).write_text(text)
    return c.argv(g)


case("settings-a-list", SETTINGS, "holds a JSON list")(lambda c: with_raw(c, SETTINGS, "[1, 2]"))
case("settings-nested", SETTINGS, "nested too deeply")(lambda c: with_raw(c, SETTINGS, "[" * 100_000))
for key, value in (("window", "16"), ("window", 16.0), ("topk", None), ("shards", 0), ("windows_per_part", True),
                   ("topk", 10 ** 6)):
    case(f"settings-{key}-{value!r}", SETTINGS, key)(
        lambda c, key=key, value=value: with_settings(c, lambda d: {**d, key: value}))
case("seal-a-list", "complete.json", "holds a JSON list")(lambda c: with_raw(c, SEAL, "[]"))
case("seal-nested", "complete.json", "nested too deeply")(lambda c: with_raw(c, SEAL, "{\"a\":" * 50_000))


def reseal(golden: Path, edit_tensors=None, raw: bytes | None = None, part: str = PART) -> Path:
    """Damage a part and recompute its seal's hash, as a forger would: only the content checks remain."""
    import hashlib

    file = golden / part
    if edit_tensors is not None:
        tensors = load_file(file)
        edit_tensors(tensors)
        save_file(tensors, str(file), metadata={"windows": "0-2"})
    if raw is not None:
        file.write_bytes(raw)
    seal = file.parent / "complete.json"
    edit_json(seal, lambda d: {**d, "parts": {**d["parts"], file.name: hashlib.sha256(file.read_bytes()).hexdigest()}})
    return golden


def set_item(name, index, value):
    return lambda t: t[name].__setitem__(index, value)


PART_DAMAGE = {
    "nan-logprob": (set_item("topk_logprobs", (0, 0, 0), float("nan")), "topk_logprobs holds NaN"),
    "half-the-topk": (lambda t: t.update(topk_ids=t["topk_ids"][..., :16].contiguous(),
                                         topk_logprobs=t["topk_logprobs"][..., :16].contiguous()), "topk_ids is"),
    "out-of-vocab-id": (set_item("topk_ids", (0, 0, 0), 10 ** 6), "outside the vocabulary"),
    "missing-tensor": (lambda t: t.pop("bf16_kl"), "bf16_kl missing or unexpected"),
    "positive-logprob": (set_item("target_logprob", (0, 0), 0.5), "log-probability above 0"),
    "other-tokens": (set_item("tokens", (0, 0), 7), "not the corpus's windows"),
}
for kind, (edit, fragment) in PART_DAMAGE.items():
    case(f"part-{kind}-resealed", PART, fragment, "delete")(lambda c, edit=edit: c.argv(reseal(c.golden(), edit)))
case("part-empty-resealed", PART, "not a readable part file")(lambda c: c.argv(reseal(c.golden(), raw=b"")))
case("part-truncated", PART, "sha256 differs")(
    lambda c: (g := c.golden(), (g / PART).write_bytes((g / PART).read_bytes()[:100]), c.argv(g))[-1])


def part_copied_over_another(c: Ctx) -> list:
    g = c.golden()
    shutil.copy(g / "shard-001-of-002/part-00000.safetensors", g / PART)
    return c.argv(reseal(g))


case("part-copied-over-another", PART, "records windows")(part_copied_over_another)
for key, value in (("corpus_sha256", "0" * 64), ("weights", {"model.safetensors": "0" * 64}), ("windows_per_part", 1),
                   ("shard", 1)):
    case(f"seal-from-another-run-{key}", "complete.json", "written for another run", key)(
        lambda c, key=key, value=value: (g := c.golden(), edit_json(g / SEAL, lambda d: {**d, key: value}),
                                         c.argv(g))[-1])

# ---- the corpus ---------------------------------------------------------------------------------


def corpus_file(c: Ctx, text: str) -> Path:
    path = c.tmp / "hostile.json"
    path.write_text(text)
    return path


for name, text, fragment in (("nested-deep", "[" * 100_000, "nested too deeply"),
                             ("nested-5000", "[" * 5000 + "]" * 5000, "nested too deeply"),
                             ("huge-id", "[" + "9" * 5000 + "]", "not a usable JSON list"),
                             ("empty-list", "[]", "holds no token ids"), ("empty-file", "", "is empty"),
                             ("shorter-than-window", json.dumps(list(range(3, 10))), "longer than the whole corpus")):
    case(f"corpus-{name}", "--window" if "window" in name else "--corpus", fragment)(
        lambda c, text=text: c.argv(c.tmp / "new-golden", corpus_file(c, text)))


def fifo_corpus(c: Ctx) -> list:
    path = c.tmp / "pipe.json"
    os.mkfifo(path)
    return c.argv(c.tmp / "new-golden", path)


case("corpus-named-pipe", "--corpus", "named pipe")(fifo_corpus)

# ---- options that must be refused before the reference pass ---------------------------------------

case("backend-xla-absent", "--backend xla", "torch-xla")(
    lambda c: c.argv(c.tmp / "new-golden", None, "--backend", "xla"))
case("backend-neuron-absent", "--backend neuron", "cannot run")(
    lambda c: c.argv(c.tmp / "new-golden", None, "--backend", "neuron"))


def user_report(c: Ctx, name: str) -> list:
    report = c.tmp / "report"
    report.mkdir()
    (report / name).write_text("my own notes")
    return c.argv(None, None, "--report", report)


for name in ("quality.json", "quality_kl.png", "worst_prompts.json", "notes.txt"):
    case(f"report-holds-user-{name}", "--report", "quality did not write", name)(lambda c, name=name: user_report(c, name))

# ---- perf files beside --markdown, long context, family configs -----------------------------------


def compare_history(c: Ctx, planted: str) -> list:
    history = c.tmp / "history"
    history.mkdir()
    for k in range(3):
        write_json(history / f"run-{k}.json", {**perf_result(), "created": f"2026-01-0{k + 1}T00:00:00+00:00"})
    (c.tmp / planted).write_bytes(b"\x89PNG\r\n\x1a\n" + b"user's own picture")
    return ["perf", "compare", "--history", history, "--markdown", c.tmp / "rep.md"]


case("markdown-trend-png-not-ours", "rep-trend.png", "not written by gemma-parity")(
    lambda c: compare_history(c, "rep-trend.png"))
case("markdown-length-png-not-ours", "rep-length.png", "not written by gemma-parity")(
    lambda c: compare_history(c, "rep-length.png"))


def huge_positions(c: Ctx) -> list:
    ckpt = edit_config(copy_checkpoint(c.tiny, c.tmp / "ckpt"),
                       lambda cfg: cfg["text_config"].update(max_position_embeddings=2 ** 31 - 1))
    return ["check", "--checkpoint", ckpt, "--kv-len", 2 ** 31 - 1, "--json", c.tmp / "c.json"]


case("kv-len-2^31-1", "--kv-len 2147483647", "GiB", "use --kv-len")(huge_positions)


def heterogeneous_full_layers(c: Ctx) -> list:
    """Layer 5 (a full layer) gets a head width of its own, weights reshaped to match: only the
    config check stands between it and transformers' own refusal inside the model class."""
    ckpt = edit_config(copy_checkpoint(c.tiny, c.tmp / "ckpt"), lambda cfg: cfg["text_config"].update(
        per_layer_config={"5": {"head_dim": 8}}))
    key = f"{TEXT}layers.5.self_attn."

    def reshape(t):
        q_heads = t[f"{key}q_proj.weight"].shape[0] // t[f"{key}q_norm.weight"].shape[0]
        kv = t[f"{key}k_proj.weight"].shape[0] // t[f"{key}k_norm.weight"].shape[0]
        hidden = t[f"{key}q_proj.weight"].shape[1]
        t.update({f"{key}q_proj.weight": torch.zeros(q_heads * 8, hidden), f"{key}o_proj.weight":
                  torch.zeros(hidden, q_heads * 8), f"{key}k_proj.weight": torch.zeros(kv * 8, hidden),
                  f"{key}q_norm.weight": torch.ones(8), f"{key}k_norm.weight": torch.ones(8)})
    rewrite_weights(ckpt, reshape)
    return ["check", "--checkpoint", ckpt, "--json", c.tmp / "c.json"]


case("per-layer-heterogeneous-full-layers", "per_layer_config gives full_attention layers different head_dim")(
    heterogeneous_full_layers)


def rates_file(c: Ctx, edit) -> list:
    rates = {"cores": 2, "hbm_bytes": 32e9, "hbm_bytes_per_s": 8.2e11, "bf16_flops_per_s": 1.9e14,
             "fp32_flops_per_s": 4.7e13, "chips": 1}
    path = c.tmp / "rates.json"
    path.write_text(edit(rates) if isinstance(edit(rates), str) else json.dumps(edit(rates)))
    return ["info", "--model", "tiny", "--instance", "my.instance", "--instance-rates", path]


for name, edit, fragment in (("nan-bandwidth", lambda r: {**r, "hbm_bytes_per_s": float("nan")}, "hbm_bytes_per_s"),
                             ("inf-flops", lambda r: {**r, "bf16_flops_per_s": float("inf")}, "bf16_flops_per_s"),
                             ("half-a-core", lambda r: {**r, "cores": 0.5}, "cores"),
                             ("nested", lambda r: "[" * 100_000, "nested too deeply")):
    case(f"instance-rates-{name}", "--instance-rates", fragment)(lambda c, edit=edit: rates_file(c, edit))


# ---- the runner ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quality_golden(tmp_path_factory, tiny0_dir):
    """A real two-shard quality golden of the tiny model (64 ids, windows of 16, one part per shard)."""
    root = tmp_path_factory.mktemp("quality-hostile")
    corpus = root / "corpus.json"
    corpus.write_text(json.dumps(json.loads((Path(__file__).parents[2] / "fixtures/corpus/tiny-20k.json")
                                            .read_text())[:CORPUS_IDS]))
    golden = root / "golden"
    from harness.cli import main

    for shard in range(SHARDS):
        assert main(["quality", "--checkpoint", str(tiny0_dir), "--corpus", str(corpus), "--golden", str(golden),
                     "--window", str(WINDOW), "--windows-per-part", str(WINDOWS_PER_PART),
                     "--shard", f"{shard}/{SHARDS}"]) == 0
    return golden, corpus


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_refused_before_model_work(case, tmp_path, tiny0_dir, quality_golden, capsys):
    _, setup, fragments = case
    ctx = Ctx(tmp_path, tiny0_dir, *quality_golden)
    argv = setup(ctx)
    roots = (tmp_path, tiny0_dir, quality_golden[0])
    before = snapshot(*roots)
    with ModelWork() as work:
        outcome = run_inprocess(argv, capsys)
    assert outcome.code == 2, outcome.err
    for fragment in fragments:
        assert fragment in outcome.err, (fragment, outcome.err)
    assert "Traceback" not in outcome.err and outcome.err.count("\n") == 1, outcome.err
    assert work.done() == {}, f"refused only after model work: {work.done()}"
    assert snapshot(*roots) == before


def test_the_intact_golden_is_accepted_and_judged(tmp_path, tiny0_dir, quality_golden, capsys):
    """The control for every case above: the same copy, undamaged, is judged (exit 0), and its
    report directory is written whole with the manifest that lets the next run replace it."""
    from harness.base.owned_dir import MANIFEST, foreign_entries

    ctx = Ctx(tmp_path, tiny0_dir, *quality_golden)
    report = tmp_path / "report"
    outcome = run_inprocess(ctx.argv(None, None, "--report", report), capsys)
    assert outcome.code == 0, outcome.err
    assert (report / MANIFEST).is_file() and foreign_entries(report) == []
    (report / "quality.json").write_text("edited by hand")
    assert foreign_entries(report) == ["quality.json"]


def test_a_killed_part_write_leaves_no_temp_behind(tmp_path, tiny0_dir, quality_golden, capsys):
    """A `.partial-*` temp of a dead writer in a shard's directory is removed by the next run."""
    ctx = Ctx(tmp_path, tiny0_dir, *quality_golden)
    golden = ctx.golden()
    stale = golden / "shard-000-of-002" / ".partial-part-00001.safetensors.999999999@00000000.x"
    stale.write_bytes(b"half a part")
    old = os.stat(stale).st_mtime - 3 * 24 * 3600
    os.utime(stale, (old, old))
    outcome = run_inprocess(ctx.argv(golden, None, "--reference-only"), capsys)
    assert outcome.code == 0, outcome.err
    assert not stale.exists()
