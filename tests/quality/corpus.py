"""A deterministic corpus for the tiny model: a Markov chain over the model's own next-token
distribution after each single token (one batched fp32 forward of every one-token prompt), sampled
with a seeded generator. Its targets are tokens the model finds plausible, as real text's are for a
real model (uniform random ids would make every target improbable and delta-p meaningless)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def _bigram(checkpoint_dir) -> torch.Tensor:
    from harness.reference.run import load_reference_model

    model = load_reference_model(checkpoint_dir, "float32")
    vocab = model.config.get_text_config().vocab_size
    with torch.no_grad():
        logits = model(input_ids=torch.arange(vocab)[:, None]).logits[:, -1].double()
    return torch.softmax(logits, -1)


def model_corpus(checkpoint_dir, n: int, seed: int = 1234) -> list[int]:
    probs = _bigram(str(checkpoint_dir))
    gen = torch.Generator().manual_seed(seed)
    draws = torch.rand(n, generator=gen, dtype=torch.float64)
    cdf = probs.cumsum(-1)
    ids, token = [], 3
    for u in draws.tolist():
        token = min(int(torch.searchsorted(cdf[token], torch.tensor([u], dtype=torch.float64))), probs.shape[0] - 1)
        token = token if token > 2 else 3  # pad/eos/bos avoided
        ids.append(token)
    return ids


if __name__ == "__main__":  # how fixtures/corpus/tiny-20k.json was made
    import json
    import sys

    from harness import FIXTURES_DIR
    from harness.inputs.tiny import tiny_checkpoint

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_480
    (FIXTURES_DIR / "corpus" / "tiny-20k.json").write_text(json.dumps(model_corpus(tiny_checkpoint(seed=0), n)) + "\n")
