"""Every bad input, table-driven: each case builds its inputs in a private directory, runs the
command, and asserts the exit status (2: bad input or environment, never 1), that the message names
the option, path or key, that a refusal needs no model work (counted, not timed: no weight tensor
read, no transformers model loaded, no module's forward; tests/model_work.py), that no
traceback is printed, and that nothing on disk changed (every file's size, mtime and hash, every
link and directory, of the case's directory, the tiny checkpoint and the shared golden)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.inputs.scenarios import (TEXT, copy_checkpoint, edit_config, perf_result,
                                    rehash_golden, rewrite_weights, run_inprocess, small_golden, snapshot,
                                    split_weights, write_json)
from tests.model_work import ModelWork


@dataclass
class Ctx:
    tmp: Path
    tiny: Path
    shared_golden: Path

    def ckpt(self, name: str = "ckpt") -> Path:
        """A private copy of the tiny checkpoint, to damage."""
        return copy_checkpoint(self.tiny, self.tmp / name)

    def golden(self, name: str = "golden") -> Path:
        """A private copy of a real golden of the tiny checkpoint (one 3-token prompt, 2 tokens)."""
        return Path(shutil.copytree(self.shared_golden, self.tmp / name))

    def file(self, name: str, content) -> Path:
        path = self.tmp / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        return path


@dataclass
class Case:
    id: str
    setup: Callable[[Ctx], list]  # -> argv; may create files in ctx.tmp
    fragments: tuple[str, ...]  # each must be in stderr; "{tmp}" and "{tiny}" are filled in
    code: int = 2
    fast: bool = True


CASES: list[Case] = []


def case(id: str, *fragments: str, code: int = 2, fast: bool = True):
    def register(setup):
        CASES.append(Case(id, setup, fragments, code, fast))
        return setup
    return register


def check_argv(ctx: Ctx, *extra) -> list:
    return ["check", "--checkpoint", ctx.tiny, "--json", ctx.tmp / "check.json", "--report", ctx.tmp / "report",
            *extra]


def prompts(ctx: Ctx, content) -> Path:
    return ctx.file("prompts.json", content)


# ---- numbers and flag conflicts ------------------------------------------------------------------

case("new-tokens-negative", "--new-tokens -3", "at least 0")(lambda c: check_argv(c, "--new-tokens", -3))
case("kv-len-negative", "--kv-len -1", "at least 1")(lambda c: check_argv(c, "--kv-len", -1))
case("kv-len-zero-info", "--kv-len 0")(lambda c: ["info", "--model", "tiny", "--kv-len", 0])
case("tp-zero", "--tp 0", "at least 1")(lambda c: check_argv(c, "--tp", 0))
case("tp-negative-info", "--tp -2")(lambda c: ["info", "--config", c.tiny / "config.json", "--tp", -2])
case("tp-does-not-divide", "--tp 3", "does not split")(lambda c: check_argv(c, "--tp", 3))
case("seed-negative", "--seed -1")(lambda c: ["check", "--model", "tiny", "--seed", -1])
case("dtype-unknown", "--dtype 'int8'")(lambda c: check_argv(c, "--dtype", "int8"))
case("dtype-unknown-bench", "--dtype 'half'", "bf16, bfloat16, float32, fp32")(
    lambda c: ["bench", "--model", "tiny", "--dtype", "half", "--out", c.tmp / "b.json"])
case("backend-option-unknown", "--backend-option compile_worker", "neuron backend has no such option")(
    lambda c: check_argv(c, "--backend", "neuron", "--backend-option", "compile_worker=4"))
case("backend-option-bad-value", "--backend-option zero_on_reset='maybe'", "true or false")(
    lambda c: ["bench", "--model", "tiny", "--backend", "neuron", "--backend-option", "zero_on_reset=maybe",
               "--out", c.tmp / "b.json"])
case("bucket-beyond-kv", "bucket 512 exceeds --kv-len 256")(lambda c: check_argv(c, "--buckets", "16,512"))
case("kv-beyond-max-positions", "--kv-len 4096", "max_position_embeddings 1024")(
    lambda c: check_argv(c, "--kv-len", 4096, "--buckets", 64))
case("new-tokens-not-a-number", "--new-tokens", "invalid int")(lambda c: check_argv(c, "--new-tokens", "many"))
case("buckets-not-numbers", "--buckets", "comma-separated integers")(lambda c: check_argv(c, "--buckets", "16,x"))
case("golden-with-prompts", "--golden", "drop --prompts")(
    lambda c: check_argv(c, "--golden", c.shared_golden, "--prompts", prompts(c, [[1, 2]])))
case("golden-with-new-tokens-even-the-default", "--golden", "drop --new-tokens")(
    lambda c: check_argv(c, "--golden", c.shared_golden, "--new-tokens", 8))
case("stream-with-new-tokens", "--new-tokens 4 with --stream")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--stream", "--new-tokens", 4, "--out", c.tmp / "g"])
case("reference-new-tokens-negative", "--new-tokens -1")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--new-tokens", -1, "--out", c.tmp / "g"])
case("bench-runs-zero", "--runs 0")(lambda c: ["bench", "--model", "tiny", "--runs", 0, "--out", c.tmp / "b.json"])
case("bench-warmup-negative", "--warmup -1")(
    lambda c: ["bench", "--model", "tiny", "--warmup", -1, "--out", c.tmp / "b.json"])
case("bench-new-tokens-zero", "--new-tokens 0")(
    lambda c: ["bench", "--model", "tiny", "--new-tokens", 0, "--out", c.tmp / "b.json"])
case("bench-decode-beyond-kv", "exceed the KV length 256", "--kv-len 320")(
    lambda c: ["bench", "--model", "tiny", "--new-tokens", 256, "--out", c.tmp / "b.json"])
case("bench-tp-does-not-divide", "--tp 5")(lambda c: ["bench", "--model", "tiny", "--tp", 5, "--out", c.tmp / "b.json"])


def compare_argv(ctx: Ctx, *extra, baseline=None, current=None) -> list:
    base = write_json(ctx.tmp / "base.json", baseline or perf_result())
    cur = write_json(ctx.tmp / "cur.json", current or perf_result())
    return ["perf", "compare", "--baseline", base, "--current", cur, *extra]


for value in ("nan", "inf", "-inf", "0.5"):
    case(f"factor-{value}", f"--factor {float(value)}", "finite number in [1, ∞)")(
        lambda c, value=value: compare_argv(c, f"--factor={value}"))
for value in ("0", "0.5", "0.7", "1", "1.5", "nan", "-0.1"):
    case(f"alpha-{value}", f"--alpha {float(value)}", "(0, 0.5)")(lambda c, value=value: compare_argv(c, f"--alpha={value}"))
for value in ("prefill_ms=-1", "prefill_ms=0", "prefill_ms=nan", "prefill_ms=inf", "=5", "prefill_ms"):
    case(f"budget-{value}", f"--budget '{value}'")(lambda c, value=value: compare_argv(c, f"--budget={value}"))
case("budget-twice", "--budget prefill_ms: given more than once")(
    lambda c: compare_argv(c, "--budget", "prefill_ms=100", "--budget", "prefill_ms=50"))
case("samples-negative", "metrics.prefill_ms[1] = -3.0", "positive finite duration")(
    lambda c: compare_argv(c, current=perf_result(prefill=(10.0, -3.0, 10.0))))
case("samples-zero", "metrics.decode_ms_per_token[0] = 0", "positive")(
    lambda c: compare_argv(c, baseline=perf_result(decode=(0, 5.0, 5.0))))
case("samples-boolean", "prefill_ms_by_bucket.64[0] = True")(
    lambda c: compare_argv(c, current={**perf_result(), "prefill_ms_by_bucket": {"64": [True, 1.0]}}))
case("perf-result-is-a-list", "not a perf result")(lambda c: compare_argv(c, current=[1, 2]))
case("compare-needs-a-pair", "give --baseline FILE and --current FILE")(
    lambda c: ["perf", "compare", "--baseline", write_json(c.tmp / "b.json", perf_result())])
case("compare-history-missing", "--history {tmp}/nohist: history directory not found")(
    lambda c: ["perf", "compare", "--history", c.tmp / "nohist"])
case("compare-baseline-is-a-directory", "--baseline {tmp}: is a directory")(
    lambda c: ["perf", "compare", "--baseline", c.tmp, "--current", write_json(c.tmp / "c.json", perf_result())])

case("samples-huge-integer", "metrics.prefill_ms must be a non-empty list of finite numbers")(
    lambda c: compare_argv(c, current=perf_result(prefill=(10 ** 400, 10.0, 10.0))))
case("samples-integer-beyond-json-digits", "not valid JSON", "4300 digits")(
    lambda c: ["perf", "compare", "--baseline", c.file("b.json", json.dumps(perf_result()).replace(
        "10.0", "1" * 5000, 1)), "--current", write_json(c.tmp / "cur.json", perf_result())])
case("perf-result-not-utf8", "{tmp}/b.json: not UTF-8")(
    lambda c: ["perf", "compare", "--baseline", c.file("b.json", json.dumps(perf_result()).encode()[:-1] + b"\xff}"),
               "--current", write_json(c.tmp / "cur.json", perf_result())])
case("perf-result-nested-deeply", "{tmp}/b.json: JSON nested more than 200 levels deep")(
    lambda c: ["perf", "compare", "--baseline", c.file("b.json", "[" * 100000), "--current",
               write_json(c.tmp / "cur.json", perf_result())])
case("perf-naive-date", "created = '2026-01-02T00:00:00' has no time zone")(
    lambda c: compare_argv(c, current={**perf_result(), "created": "2026-01-02T00:00:00"}))


def history(c: Ctx, *results, extra=None) -> Path:
    directory = c.tmp / "h"
    directory.mkdir()
    for k, result in enumerate(results):
        write_json(directory / f"run{k}.json", result)
    if extra:
        extra(directory)
    return directory


case("history-naive-and-aware-dates", "{tmp}/h/run1.json: created = '2026-01-02T00:00:00' has no time zone")(
    lambda c: ["perf", "compare", "--history", history(c, perf_result(), {**perf_result(), "created": "2026-01-02T00:00:00"})])
case("history-huge-integer", "run1.json: metrics.decode_ms_per_token must be a non-empty list of finite numbers")(
    lambda c: ["perf", "compare", "--history", history(c, perf_result(), perf_result(decode=(5.0, 2 ** 2000)))])
case("history-not-utf8", "{tmp}/h/run1.json: not UTF-8")(
    lambda c: ["perf", "compare", "--history", history(c, perf_result(), extra=lambda d: (d / "run1.json").write_bytes(
        b"\xfe" + json.dumps(perf_result()).encode()))])
case("history-nested-deeply", "JSON nested more than 200 levels deep")(
    lambda c: ["perf", "compare", "--history", history(c, perf_result(), extra=lambda d: (d / "run1.json").write_text(
        "{\"a\":" * 50000))])
# a named pipe or a directory called *.json is not a run: skipped with a note, never read (a pipe
# would block for ever); with no regular run file left the history is refused
case("history-only-a-named-pipe", "{tmp}/h/run.json: not a regular file, so not a run; skipped", "no run files")(
    lambda c: ["perf", "compare", "--history", history(c, extra=lambda d: os.mkfifo(d / "run.json"))])
case("history-only-a-directory", "{tmp}/h/run.json: not a regular file", "no run files")(
    lambda c: ["perf", "compare", "--history", history(c, extra=lambda d: (d / "run.json").mkdir())])

# ---- prompt files --------------------------------------------------------------------------------

def with_prompts(content, *extra):
    return lambda c: check_argv(c, "--prompts", prompts(c, content), *extra)


case("prompts-not-utf8", "{tmp}/prompts.json", "not UTF-8")(with_prompts(b"[[1, 2], \xff\xfe]"))
case("prompts-empty-file", "{tmp}/prompts.json", "not valid JSON")(with_prompts(""))
case("prompts-object", "{tmp}/prompts.json", "non-empty JSON list")(with_prompts({"prompts": [[1, 2]]}))
case("prompts-booleans", "{tmp}/prompts.json", "prompt 0", "booleans")(with_prompts([[True, 5, False]]))
case("prompts-float-ids", "prompt 1", "integer token ids")(with_prompts([[1, 2], [1.0, 2.5]]))
case("prompts-nested", "prompt 0", "integer token ids")(with_prompts([[[1, 2]]]))
case("prompts-nan", "prompt 0", "integer token ids")(with_prompts(b"[[1, NaN]]"))
case("prompts-huge-id", "token id 1000000000000000000000000000000 at position 1")(with_prompts([[1, 10 ** 30]]))
case("prompts-negative-id", "token id -1 at position 0", "[0, 512)")(with_prompts([[-1]]))
case("prompts-empty-prompt", "prompt 1 is empty")(with_prompts([[3], []]))
case("prompts-empty-string", "prompt 0 is an empty string")(with_prompts(["   "]))
case("prompts-string-no-tokenizer", "prompt 0 is a string", "no tokenizer")(with_prompts(["hello"]))
case("prompts-missing", "--prompts {tmp}/none.json: not found")(
    lambda c: check_argv(c, "--prompts", c.tmp / "none.json"))
case("prompts-directory", "--prompts {tmp}: is a directory")(lambda c: check_argv(c, "--prompts", c.tmp))
# a prompt longer than the largest bucket is prefilled in chunks: only the KV length refuses it
case("prompt-longer-than-kv-len", "prompt 0 has 257 tokens", "--kv-len is 256")(
    with_prompts([list(range(3, 260))]))
case("prompt-plus-tokens-beyond-kv", "--new-tokens 1000000", "--kv-len is 256", "--new-tokens 197")(
    with_prompts([list(range(3, 63))], "--new-tokens", 1000000))
case("reference-beyond-max-positions", "max_position_embeddings 1024")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--prompts", prompts(c, [[5, 6]]), "--new-tokens", 5000,
               "--out", c.tmp / "g"])
case("reference-prompt-booleans", "booleans")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--prompts", prompts(c, [[True]]), "--out", c.tmp / "g"])


# ---- output locations ----------------------------------------------------------------------------

def reference_to(out_fn, *extra):
    def setup(c):
        ckpt = c.ckpt()
        return ["reference", "--checkpoint", ckpt, "--out", out_fn(c, ckpt), *extra]
    return setup


case("out-is-the-checkpoint", "--out {tmp}/ckpt: is --checkpoint")(reference_to(lambda c, k: k, "--overwrite"))
case("out-inside-the-checkpoint", "is inside --checkpoint")(reference_to(lambda c, k: k / "golden"))
case("out-contains-the-checkpoint", "--out {tmp}: contains --checkpoint")(reference_to(lambda c, k: c.tmp, "--overwrite"))
case("out-contains-the-prompts", "contains --prompts")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--prompts", (c.tmp / "d").mkdir() or c.file("d/p.json", [[1]]),
               "--out", c.tmp / "d", "--overwrite"])
case("out-is-the-tiny-cache", "is the tiny-model cache entry")(
    lambda c: ["reference", "--model", "tiny", "--out", c.tiny, "--overwrite"])
case("overwrite-unrelated-directory", "--overwrite replaces only a golden", "nothing was touched")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--out", (c.file("notes.txt", "mine") and c.tmp), "--overwrite"])
@case("overwrite-golden-with-extra-files", "not part of the golden (notes.txt)", "nothing was touched")
def _golden_with_notes(c: Ctx) -> list:
    golden = c.golden()
    (golden / "notes.txt").write_text("the user's notes, kept beside the golden")
    return ["reference", "--checkpoint", c.tiny, "--out", golden, "--overwrite"]
case("existing-golden-without-overwrite", "already exists", "--overwrite")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--out", c.golden()])
case("out-is-a-file", "--out {tmp}/f: exists and is not a directory")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--out", c.file("f", "x")])
case("json-is-a-directory", "--json {tmp}: is a directory")(
    lambda c: ["info", "--model", "tiny", "--json", c.tmp])
case("json-is-the-config", "--json {tiny}/config.json: is inside the tiny-model cache entry")(
    lambda c: ["info", "--model", "tiny", "--json", c.tiny / "config.json"])
case("json-is-the-config-file", "--json {tmp}/config.json: is --config")(
    lambda c: ["info", "--config", c.file("config.json", (c.tiny / "config.json").read_text()),
               "--json", c.tmp / "config.json"])
case("json-inside-the-golden", "is inside --golden")(
    lambda c: ["check", "--checkpoint", c.tiny, "--golden", c.shared_golden, "--json", c.shared_golden / "x.json"])
case("json-is-the-prompts", "--json {tmp}/prompts.json: is --prompts")(
    lambda c: ["check", "--checkpoint", c.tiny, "--prompts", prompts(c, [[1]]), "--json", c.tmp / "prompts.json"])
case("json-not-ours", "--json {tmp}/mine.json: exists and was not written by gemma-parity")(
    lambda c: ["info", "--model", "tiny", "--json", c.file("mine.json", {"my": "data"})])
case("json-not-json", "not written by gemma-parity")(
    lambda c: ["info", "--model", "tiny", "--json", c.file("notes.txt", "my notes")])
case("json-under-a-file", "{tmp}/f is a file, not a directory")(
    lambda c: ["info", "--model", "tiny", "--json", c.file("f", "x") / "x.json"])
case("json-empty-path", "--json: empty path")(lambda c: ["info", "--model", "tiny", "--json", ""])
case("json-nul-byte", "NUL byte")(lambda c: ["info", "--model", "tiny", "--json", "a\0b.json"])
case("json-symlink", "--json {tmp}/link.json: is a symbolic link")(
    lambda c: ["info", "--model", "tiny", "--json", os.symlink(c.file("t.json", "{}"), c.tmp / "link.json")
               or c.tmp / "link.json"])
case("json-name-too-long", "longer than 255 bytes")(lambda c: ["info", "--model", "tiny", "--json", c.tmp / ("x" * 300)])
case("report-entry-is-a-directory", "not part of a gemma-parity report (check.json)")(
    lambda c: check_argv(c)[:-2] + ["--report", (c.tmp / "r" / "check.json").mkdir(parents=True) or c.tmp / "r"])
case("json-unwritable-location", "--json /sys/gemma-parity.json", "permission denied")(
    lambda c: ["info", "--model", "tiny", "--json", "/sys/gemma-parity.json"])
case("report-is-a-file", "--report {tmp}/r: exists and is not a directory")(
    lambda c: check_argv(c)[:-2] + ["--report", c.file("r", "x")])
case("report-dir-has-other-files", "not part of a gemma-parity report (keep.txt)")(
    lambda c: check_argv(c)[:-2] + ["--report", (c.tmp / "r").mkdir() or c.file("r/keep.txt", "x").parent])
case("json-inside-report", "--report {tmp}/r: contains --json {tmp}/r/check.json")(
    lambda c: ["check", "--model", "tiny", "--report", c.tmp / "r", "--json", c.tmp / "r" / "check.json"])
case("bench-out-exists", "--out {tmp}/b.json: already exists", "--force")(
    lambda c: ["bench", "--model", "tiny", "--out", write_json(c.tmp / "b.json", perf_result())])
case("bench-force-over-foreign-file", "--out {tmp}/b.json: exists and was not written by gemma-parity")(
    lambda c: ["bench", "--model", "tiny", "--force", "--out", c.file("b.json", {"mine": 1})])
case("bench-history-is-a-file", "--history {tmp}/h: exists and is not a directory")(
    lambda c: ["bench", "--model", "tiny", "--out", c.tmp / "b.json", "--history", c.file("h", "x")])
case("compare-json-is-the-baseline", "--json {tmp}/base.json: is --baseline")(
    lambda c: compare_argv(c, "--json", c.tmp / "base.json"))
case("compare-markdown-not-ours", "--markdown {tmp}/README.md: exists and was not written by gemma-parity")(
    lambda c: compare_argv(c, "--markdown", c.file("README.md", "# my project")))
case("compare-json-inside-history", "is inside --history")(
    lambda c: ["perf", "compare", "--history", (c.tmp / "h").mkdir() or c.tmp / "h", "--json", c.tmp / "h" / "x.json"])


# ---- checkpoints ---------------------------------------------------------------------------------

def info_of(setup_ckpt):
    return lambda c: ["info", "--checkpoint", setup_ckpt(c), "--json", c.tmp / "info.json"]


case("shards-without-index", "{tmp}/ckpt", "no model.safetensors and no model.safetensors.index.json",
     "model-00001-of-00002.safetensors")(info_of(lambda c: (k := c.ckpt(), split_weights(k, f"{TEXT}layers.3.",
                                                                                    index=False))[0]))
case("key-defined-twice", f"key {TEXT}layers.3.", "stored twice", "model-00001-of-00002.safetensors",
     "model-00002-of-00002.safetensors")(
    info_of(lambda c: (k := c.ckpt(), split_weights(k, f"{TEXT}layers.3.", duplicate=True))[0]))
case("index-disagrees-with-shards", "lists key", "no shard holds it")(
    info_of(lambda c: (k := c.ckpt(), split_weights(k, f"{TEXT}layers.3."),
                       rewrite_weights(k, lambda t: t.pop(f"{TEXT}layers.3.mlp.up_proj.weight"),
                                       "model-00002-of-00002.safetensors"))[0]))
case("index-is-a-list", "model.safetensors.index.json: not a valid safetensors index")(
    info_of(lambda c: (k := c.ckpt(), split_weights(k, f"{TEXT}layers.3."),
                       (k / "model.safetensors.index.json").write_text("[1, 2]"))[0]))
case("index-escapes-the-directory", "'../model-00002-of-00002.safetensors'", "inside")(
    info_of(lambda c: (k := c.ckpt(), split_weights(k, f"{TEXT}layers.3."),
                       (k / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
                           "a": "../model-00002-of-00002.safetensors"}})))[0]))
case("index-not-utf8", "not a valid safetensors index")(
    info_of(lambda c: (k := c.ckpt(), split_weights(k, f"{TEXT}layers.3."),
                       (k / "model.safetensors.index.json").write_bytes(b"{\xff}"))[0]))
case("integer-weight", f"{TEXT}layers.2.layer_scalar is stored as I64", "not a floating-point type")(
    info_of(lambda c: rewrite_weights(c.ckpt(), lambda t: t.update({f"{TEXT}layers.2.layer_scalar": torch.ones(
        1, dtype=torch.int64)}))))
case("boolean-weight", f"{TEXT}norm.weight is stored as BOOL")(
    info_of(lambda c: rewrite_weights(c.ckpt(), lambda t: t.update({f"{TEXT}norm.weight": torch.ones(
        64, dtype=torch.bool)}))))
case("unexpected-decoder-layer", f"{TEXT}layers.12.", "not used by the model", "num_hidden_layers")(
    info_of(lambda c: rewrite_weights(c.ckpt(), lambda t: t.update({f"{TEXT}layers.12.layer_scalar": torch.ones(1)}))))
case("v-proj-on-a-k-eq-v-layer", f"{TEXT}layers.5.self_attn.v_proj.weight", "attention_k_eq_v")(
    info_of(lambda c: rewrite_weights(c.ckpt(), lambda t: t.update({
        f"{TEXT}layers.5.self_attn.v_proj.weight": torch.zeros(32, 64)}))))
case("explicit-weights-missing", "transformers_weights but not found")(
    info_of(lambda c: edit_config(c.ckpt(), lambda cfg: cfg.update(transformers_weights="other.safetensors"))))
for key, value, fragment in [("num_attention_heads", 0, "num_attention_heads=0"),
                             ("num_key_value_heads", 3, "must divide num_attention_heads=16"),
                             ("sliding_window", 0, "sliding_window=0"), ("sliding_window", None, "sliding_window=None"),
                             ("hidden_size", True, "hidden_size=True"), ("head_dim", 15, "must be even"),
                             ("vocab_size", "512", "vocab_size='512'"), ("rms_norm_eps", -1e-6, "rms_norm_eps"),
                             ("final_logit_softcapping", float("inf"), "final_logit_softcapping"),
                             ("layer_types", ["full_attention"], "layer_types"),
                             ("pad_token_id", 512, "pad_token_id=512"), ("num_kv_shared_layers", "x", "num_kv_shared_layers")]:
    case(f"config-{key}-{value}", "{tmp}/ckpt/config.json", fragment)(
        info_of(lambda c, key=key, value=value: edit_config(c.ckpt(), lambda cfg: cfg["text_config"].update({key: value}))))
def per_layer(c: Ctx, overrides: dict, shape_weights: bool = False) -> Path:
    """A private checkpoint whose config overrides layer 5 (a full layer) per layer; with
    `shape_weights` its tensors are reshaped to match, so only the config check can refuse it."""
    ckpt = edit_config(c.ckpt(), lambda cfg: cfg["text_config"].update(per_layer_config={"05": overrides}))
    if shape_weights:
        d, kv = overrides.get("head_dim", 32), overrides.get("num_key_value_heads", 1)
        key = f"{TEXT}layers.5.self_attn."
        rewrite_weights(ckpt, lambda t: t.update({
            f"{key}q_proj.weight": torch.zeros(16 * d, 64), f"{key}o_proj.weight": torch.zeros(64, 16 * d),
            f"{key}k_proj.weight": torch.zeros(kv * d, 64), f"{key}q_norm.weight": torch.ones(d),
            f"{key}k_norm.weight": torch.ones(d)}))
    return ckpt


for overrides, fragment in [({"head_dim": 0}, "head_dim=0 must be a positive integer"),
                            ({"head_dim": -32}, "head_dim=-32 must be a positive integer"),
                            ({"head_dim": 31}, "head_dim=31 must be even"),
                            ({"num_key_value_heads": 0}, "num_key_value_heads=0 must be a positive integer"),
                            ({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=16"),
                            ({"intermediate_size": 64}, "unsupported config key intermediate_size=64")]:
    name = "-".join(f"{k}{v}" for k, v in overrides.items())
    case(f"per-layer-{name}-info", "{tmp}/ckpt/config.json: per_layer_config['05']", fragment)(
        info_of(lambda c, overrides=overrides: per_layer(c, overrides)))
for overrides in ({"head_dim": 0}, {"num_key_value_heads": 0}, {"head_dim": 31}):
    name = "-".join(f"{k}{v}" for k, v in overrides.items())
    case(f"per-layer-{name}-check-weights-shaped-to-match", "per_layer_config['05']")(
        lambda c, overrides=overrides: ["check", "--checkpoint", per_layer(c, overrides, shape_weights=True),
                                        "--json", c.tmp / "c.json"])
case("per-layer-index-out-of-range", "per_layer_config['12']: the key is not a layer index in [0, 12)")(
    info_of(lambda c: edit_config(c.ckpt(), lambda cfg: cfg["text_config"].update(per_layer_config={"12": {}}))))
case("per-layer-index-twice", "is given twice")(
    info_of(lambda c: edit_config(c.ckpt(), lambda cfg: cfg["text_config"].update(
        per_layer_config={"5": {"head_dim": 32}, "05": {"head_dim": 32}}))))
AUDIO = "model.embed_audio.embedding_projection.weight"  # inert: the port never reads it, transformers loads it
for shape in ((64, 0), (0, 16), (64, 17)):
    for command in ("check", "reference"):
        case(f"inert-audio-{shape[0]}x{shape[1]}-{command}", f"{AUDIO} has shape {shape}",
             "transformers' model for config.json has (64, 16)", fast=False)(
            lambda c, shape=shape, command=command: [
                command, "--checkpoint", rewrite_weights(c.ckpt(), lambda t: t.update({AUDIO: torch.zeros(shape)})),
                "--prompts", prompts(c, [[5, 6, 7]]), "--new-tokens", 1,
                *(["--json", c.tmp / "c.json"] if command == "check" else ["--out", c.tmp / "g"])])
case("config-missing-hidden-size", "hidden_size=None is missing")(
    info_of(lambda c: edit_config(c.ckpt(), lambda cfg: cfg["text_config"].pop("hidden_size"))))
case("config-is-a-list", "expected a JSON object")(
    lambda c: ["info", "--config", c.file("config.json", [1, 2])])
case("config-not-utf8", "{tmp}/config.json: not UTF-8")(lambda c: ["info", "--config", c.file("config.json", b"\xff{}")])
case("config-nested-deeply", "{tmp}/config.json: JSON nested more than 200 levels deep")(
    lambda c: ["info", "--config", c.file("config.json", '{"text_config":' * 100000)])
case("checkpoint-config-nested-deeply", "{tmp}/ckpt/config.json: JSON nested more than 200 levels deep")(
    info_of(lambda c: (k := c.ckpt(), (k / "config.json").write_text("[" * 5000 + "]" * 5000))[0]))
case("index-nested-deeply", "model.safetensors.index.json: JSON nested more than 200 levels deep")(
    info_of(lambda c: (k := c.ckpt(), split_weights(k, f"{TEXT}layers.3."),
                       (k / "model.safetensors.index.json").write_text('{"weight_map":' * 3000))[0]))
case("prompts-nested-deeply", "{tmp}/prompts.json: JSON nested more than 200 levels deep")(with_prompts("[" * 100000))
NOT_UTF8 = os.fsdecode(b"\xff")  # a non-UTF-8 argument byte, as Python hands it over
case("argv-not-utf8-config-missing", "--config {tmp}/c\\xff.json: not found")(
    lambda c: ["info", "--config", c.tmp / f"c{NOT_UTF8}.json"])
case("argv-not-utf8-golden-edited", "{tmp}/g\\xff/manifest.json", "do not match its golden_sha256")(
    lambda c: check_golden(lambda c: edit_manifest_only(c, lambda m: m.update(created="x")).rename(
        c.tmp / f"g{NOT_UTF8}"))(c))
case("config-is-a-directory", "--config {tmp}: is a directory")(lambda c: ["info", "--config", c.tmp])
case("checkpoint-missing", "--checkpoint {tmp}/nothing: not found")(lambda c: check_argv(c)[:1] + [
    "--checkpoint", c.tmp / "nothing"])
case("checkpoint-empty-string", "--checkpoint: empty path")(lambda c: ["check", "--checkpoint", ""])
case("prompts-empty-string-path", "--prompts: empty path")(lambda c: check_argv(c, "--prompts", ""))
case("golden-empty-string-path", "--golden: empty path")(lambda c: ["bisect", "--model", "tiny", "--golden", ""])
case("prompts-a-device", "--prompts /dev/zero: is not a regular file")(lambda c: check_argv(c, "--prompts", "/dev/zero"))
case("config-a-device", "--config /dev/zero: is not a regular file")(lambda c: ["info", "--config", "/dev/zero"])
case("seed-too-large", "--seed 99999999999999999999: too large")(
    lambda c: ["check", "--model", "tiny", "--seed", 99999999999999999999])
case("new-tokens-too-large", "--new-tokens", "too large")(lambda c: check_argv(c, "--new-tokens", 10 ** 30))
case("config-too-many-layers", "num_hidden_layers=100000", "implausibly large")(
    info_of(lambda c: edit_config(c.ckpt(), lambda cfg: cfg["text_config"].update(num_hidden_layers=100000))))
case("out-inside-a-golden", "is inside the golden")(
    lambda c: ["reference", "--checkpoint", c.tiny, "--out", c.shared_golden / "sub"])
case("checkpoint-is-a-file", "is not a directory")(lambda c: ["check", "--checkpoint", c.file("x", "x")])
case("checkpoint-empty-directory", "config.json not found")(lambda c: ["info", "--checkpoint", c.tmp])


# ---- goldens -------------------------------------------------------------------------------------

def check_golden(golden_fn, *extra):
    return lambda c: ["check", "--checkpoint", c.tiny, "--golden", golden_fn(c), "--json", c.tmp / "c.json", *extra]


def edit_manifest_only(c: Ctx, edit) -> Path:
    golden = c.golden()
    manifest = json.loads((golden / "manifest.json").read_text())
    edit(manifest)
    (golden / "manifest.json").write_text(json.dumps(manifest))
    return golden


case("golden-manifest-edited", "{tmp}/golden/manifest.json", "was edited or corrupted")(
    check_golden(lambda c: edit_manifest_only(c, lambda m: m["results"]["float32"][0]["generated"].reverse())))
case("golden-prompts-edited", "was edited or corrupted")(
    check_golden(lambda c: edit_manifest_only(c, lambda m: m["prompts"][0].__setitem__(0, 9))))
case("golden-tensors-flipped", "tensors.safetensors", "does not match")(
    check_golden(lambda c: (g := c.golden(), (g / "tensors.safetensors").write_bytes(
        (g / "tensors.safetensors").read_bytes()[:-1] + b"\x01"))[0]))
case("golden-non-finite", "float32.p0.layers.4.output contains NaN or Inf")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_tensors=lambda t: t["float32.p0.layers.4.output"].__setitem__(
        (1, 2), float("nan")))))
case("golden-prompt-shape-mismatch", "inconsistent golden", "p0.embeddings has shape (3, 64), expected (4, 64)")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m["prompts"][0].append(9))))
case("golden-results-too-short", "inconsistent golden", "results.float32[0].generated must be 2 token ids")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m["results"]["float32"][0][
        "generated"].pop())))
case("golden-new-tokens-boolean", "new_tokens True")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m.update(new_tokens=True))))
case("golden-old-format", "format_version 1", "regenerate")(
    check_golden(lambda c: edit_manifest_only(c, lambda m: m.update(format_version=1))))
case("golden-manifest-a-list", "not a golden manifest")(
    check_golden(lambda c: (g := c.golden(), (g / "manifest.json").write_text("[]"))[0]))
case("golden-is-a-file", "--golden {tmp}/g: is not a directory")(check_golden(lambda c: c.file("g", "x")))
case("golden-empty-directory", "no manifest.json")(check_golden(lambda c: (c.tmp / "g").mkdir() or c.tmp / "g"))
case("golden-prompt-outside-vocab", "golden", "token id 600 at position 0", "outside the vocabulary")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m["prompts"][0].__setitem__(0, 600))))
case("golden-generated-outside-vocab", "results.float32[0].generated must be 2 token ids")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m["results"]["float32"][0][
        "generated"].__setitem__(0, 9999))))
case("golden-without-bfloat16", "no bfloat16 reference in this golden")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m["results"].pop("bfloat16"),
                                         edit_tensors=lambda t: [t.pop(k) for k in sorted(t) if k.startswith("bf")])))
case("golden-bfloat16-tensors-without-their-results", "bfloat16.p0.", "is not one the reference writes")(
    check_golden(lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m["results"].pop("bfloat16"))))
case("golden-of-other-weights", "written from other weights", "gemma-parity bisect")(
    lambda c: ["check", "--checkpoint", rewrite_weights(c.ckpt(), lambda t: t[f"{TEXT}norm.weight"].mul_(2)),
               "--golden", c.shared_golden])
case("golden-prompt-beyond-kv-len", "golden", "prompt 0 has 3 tokens", "--kv-len is 2")(
    lambda c: ["bisect", "--checkpoint", c.tiny, "--golden", c.shared_golden, "--buckets", 2, "--kv-len", 2])



# ---- a pipe, a directory or a device where a file belongs: named for what it is, never "missing"

def replace_by(path: Path, kind: str) -> None:
    path.unlink()
    {"directory": path.mkdir, "pipe": lambda: os.mkfifo(path), "device": lambda: path.symlink_to("/dev/zero")}[kind]()


WHAT = {"directory": "is a directory", "pipe": "is a named pipe", "device": "is a character device"}
for kind in WHAT:
    case(f"golden-tensors-a-{kind}", "{tmp}/golden/tensors.safetensors: " + WHAT[kind], "not the golden's tensor file")(
        check_golden(lambda c, kind=kind: (g := c.golden(), replace_by(g / "tensors.safetensors", kind))[0]))
    case(f"golden-manifest-a-{kind}", "{tmp}/golden/manifest.json: " + WHAT[kind])(
        check_golden(lambda c, kind=kind: (g := c.golden(), replace_by(g / "manifest.json", kind))[0]))
    case(f"checkpoint-config-a-{kind}", "{tmp}/ckpt/config.json: config.json " + WHAT[kind])(
        info_of(lambda c, kind=kind: (k := c.ckpt(), replace_by(k / "config.json", kind))[0]))
    case(f"checkpoint-weights-a-{kind}", "{tmp}/ckpt/model.safetensors: " + WHAT[kind], "transformers would")(
        info_of(lambda c, kind=kind: (k := c.ckpt(), replace_by(k / "model.safetensors", kind))[0]))

# ---- the golden contract: edited, truncated or foreign goldens are bad input in every command -----

def reshape(key: str, shape):
    """Replace one capture by a tensor of another shape (and re-seal the golden)."""
    return lambda t: t.__setitem__(key, torch.zeros(shape))


GOLDEN_KINDS = {
    # edited, hash left stale
    "edited-manifest": (lambda c: edit_manifest_only(c, lambda m: m.update(created="2020-01-01T00:00:00+00:00")),
                        "do not match its golden_sha256"),
    "edited-tensor-bytes": (lambda c: (g := c.golden(), (g / "tensors.safetensors").write_bytes(
        (g / "tensors.safetensors").read_bytes()[:-4] + b"\0\0\0\1"))[0], "does not match the manifest"),
    # edited and re-sealed: only the content checks stand in the way
    "edited-token": (lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m["results"]["float32"][0][
        "generated"].__setitem__(1, (m["results"]["float32"][0]["generated"][1] + 1) % 512)),
        "generated[1]", "is not the argmax of its step's logits"),
    "reshaped-kv": (lambda c: rehash_golden(c.golden(), edit_tensors=reshape("float32.p0.kv.3.k", (4, 64))),
                    "float32.p0.kv.3.k has shape (4, 64), expected (4, 128)"),
    "reshaped-full-layer-kv": (lambda c: rehash_golden(c.golden(), edit_tensors=reshape("bfloat16.p0.kv.5.v", (4, 128))),
                               "bfloat16.p0.kv.5.v has shape (4, 128), expected (4, 32)"),
    "reshaped-decode": (lambda c: rehash_golden(c.golden(), edit_tensors=reshape("float32.p0.decode.layers.3.output",
                                                                                  (1, 32))),
                        "decode.layers.3.output has shape (1, 32), expected (1, 64)"),
    "reshaped-capped-logits": (lambda c: rehash_golden(c.golden(), edit_tensors=reshape("float32.p0.capped_logits",
                                                                                         (3, 100))),
                               "float32.p0.capped_logits has shape (3, 100), expected (3, 512)"),
    "reshaped-step-capped-logits": (lambda c: rehash_golden(c.golden(), edit_tensors=reshape(
        "bfloat16.p0.step_capped_logits", (1, 512))), "step_capped_logits has shape (1, 512), expected (2, 512)"),
    "integer-tensor": (lambda c: rehash_golden(c.golden(), edit_tensors=lambda t: t.__setitem__(
        "float32.p0.logits", t["float32.p0.logits"].to(torch.int64))), "float32.p0.logits is int64"),
    "half-a-group": (lambda c: rehash_golden(c.golden(), edit_tensors=lambda t: t.pop("float32.p0.kv.7.v")),
                     "tensor float32.p0.kv.7.v is missing"),
    "stray-tensor": (lambda c: rehash_golden(c.golden(), edit_tensors=lambda t: t.__setitem__(
        "float32.p0.layers.99.output", torch.zeros(3, 64))), "float32.p0.layers.99.output is not one the reference"),
    # truncated
    "truncated-tensors": (lambda c: (g := c.golden(), (g / "tensors.safetensors").write_bytes(
        (g / "tensors.safetensors").read_bytes()[:4096]))[0], "does not match the manifest"),
    "truncated-tensors-resealed": (lambda c: rehash_golden(c.golden(), edit_tensors=lambda t: [
        t.pop(k) for k in sorted(t) if k.startswith("bfloat16.p0.decode.")]), "bfloat16.p0 and float32.p0 differ", "decode captures"),
    "truncated-manifest": (lambda c: (g := c.golden(), (g / "manifest.json").write_bytes(
        (g / "manifest.json").read_bytes()[:200]))[0], "manifest.json: not valid JSON"),
    # foreign
    "foreign-spec": (lambda c: rehash_golden(c.golden(), edit_manifest=lambda m: m.update(spec_hash="0123456789abcdef")),
                     "golden was made for spec 0123456789abcdef"),
    "foreign-manifest": (lambda c: (g := c.golden(), (g / "manifest.json").write_text(json.dumps(
        {"format_version": 2, "name": "my notes"})))[0], "does not match the manifest"),
    "foreign-json-nested": (lambda c: (g := c.golden(), (g / "manifest.json").write_text("[" * 100000))[0],
                            "manifest.json: JSON nested more than 200 levels deep"),
}


def golden_argv(command: str, make):
    return lambda c: [command, "--checkpoint", c.tiny, "--golden", make(c), "--json", c.tmp / "out.json"]


for command in ("check", "bisect"):
    for kind, (make, *fragments) in GOLDEN_KINDS.items():
        case(f"golden-{kind}-{command}", *fragments)(golden_argv(command, make))

# ---- the runner ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared_golden(tmp_path_factory, tiny0_ckpt):
    return small_golden(tmp_path_factory.mktemp("shared") / "golden", tiny0_ckpt)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused(case: Case, tmp_path, tiny0_dir, shared_golden, capsys):
    ctx = Ctx(tmp_path, tiny0_dir, shared_golden)
    argv = case.setup(ctx)
    roots = (tmp_path, tiny0_dir, shared_golden)
    before = snapshot(*roots)
    with ModelWork() as work:
        try:
            outcome = run_inprocess(argv, capsys)
        except SystemExit as exc:  # argparse's own refusals
            outcome = type("O", (), {"code": exc.code, "err": capsys.readouterr().err})()
    assert outcome.code == case.code, outcome.err
    for fragment in case.fragments:
        fragment = fragment.replace("{tmp}", str(tmp_path)).replace("{tiny}", str(tiny0_dir))
        assert fragment in outcome.err, (fragment, outcome.err)
    assert "Traceback" not in outcome.err and ".partial-" not in outcome.err
    if case.fast:
        assert work.done() == {}, f"refused only after model work: {work.done()}"
    assert snapshot(*roots) == before

