"""The census's trained member (issue 45): a tiny gemma4 text decoder trained for a few CPU minutes
on text that ships with Python (the standard library's own source), byte-level. Trained weights give
what random ones do not: peaked next-token distributions and sharp attention, where bf16's moves of
a decision's margin have a heavy tail.

The checkpoint is cached under the tiny-model cache (harness.inputs.tiny.cache_dir) by a hash of the
recipe, so only the first run trains (`python -m tests.census.trained` builds it and prints its loss).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import time
from pathlib import Path

import torch

SLIDING, FULL = "sliding_attention", "full_attention"
# byte-level: ids 0/1/2 are pad/bos/eos, byte b is id b + 3; 260 splits over 2 ranks
VOCAB, OFFSET = 260, 3
CONFIG = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
          "num_global_key_value_heads": 2, "layer_types": [SLIDING, FULL, SLIDING, FULL], "sliding_window": 16,
          "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
          "hidden_size_per_layer_input": 0, "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2, "tie_word_embeddings": True}
RECIPE = {"config": CONFIG, "modules": ["textwrap", "string", "shlex", "fnmatch", "glob", "bisect", "heapq"],
          "steps": 300, "batch": 16, "length": 64, "lr": 3e-3, "seed": 0}


def corpus() -> bytes:
    """The standard library's own source of RECIPE's modules, and the Zen of Python."""
    import codecs
    import importlib
    import importlib.util

    parts = [inspect.getsource(importlib.import_module(m)) for m in RECIPE["modules"]]
    zen = Path(importlib.util.find_spec("this").origin).read_text()  # read, not imported: importing prints it
    parts.append(codecs.decode(zen.split('"""')[1], "rot13"))
    return "\n".join(parts).encode("utf-8")


def encode(data: bytes) -> list[int]:
    return [b + OFFSET for b in data]


def _key() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def train(out: Path) -> float:
    """Train the recipe's model and save it to `out`; returns the last steps' mean loss."""
    import transformers

    torch.manual_seed(RECIPE["seed"])
    torch.set_num_threads(1)  # a model this small trains faster on one thread than on two that contend
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**CONFIG))
    model.config._attn_implementation = "eager"
    data = torch.tensor(encode(corpus()))
    opt = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(RECIPE["seed"])
    length, losses = RECIPE["length"], []
    model.train()
    for step in range(RECIPE["steps"]):
        starts = torch.randint(0, data.numel() - length - 1, (RECIPE["batch"],), generator=gen)
        batch = torch.stack([data[s:s + length] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    model.save_pretrained(out)
    return sum(losses[-20:]) / 20


def trained_checkpoint() -> Path:
    """The trained checkpoint's directory: from the cache, or trained now and cached (written to a
    temporary directory first, so a half-written checkpoint is never left behind)."""
    from harness.inputs.tiny import cache_dir

    final = cache_dir() / f"census-trained-{_key()}"
    if (final / "config.json").is_file():
        return final
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    threads = torch.get_num_threads()
    try:
        loss = train(tmp)
    finally:
        torch.set_num_threads(threads)
    (tmp / "training.json").write_text(json.dumps({"recipe": RECIPE, "final_loss": loss}, indent=1))
    tmp.rename(final)
    return final


def prompts() -> tuple:
    """In-distribution prompts: byte slices of the corpus (the Zen, a source line), 40 and 5 bytes."""
    text = corpus()
    zen = text.index(b"Beautiful is better")
    return tuple(encode(text[zen:zen + 40])), tuple(encode(text[100:105]))


if __name__ == "__main__":
    start = time.perf_counter()
    path = trained_checkpoint()
    print(path, json.loads((path / "training.json").read_text())["final_loss"], f"{time.perf_counter() - start:.0f}s")
