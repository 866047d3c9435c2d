"""`bench --assistant DIR --speculate K`: speculative decode timed beside plain decode on the same
perf build (docs/speculative.md#bench).

Per run, on the headline prompt: plain greedy decode of `new_tokens` tokens (ms per token after the
prefill), speculative greedy decode of the same tokens (harness/port/speculate.py, ms per token
after the prefill, accepted drafts per verify), and the cost of one verify call (k+1 tokens) and of
one draft step against one decode step. Medians over runs. Beside the measured speed-up, the model
of it on a memory-bound device (inf2): a decode step and a verify each read the target's weights
once, a draft step reads the drafter's, so a round of k drafts and one verify costs
1 + k x (drafter bytes / target bytes) decode steps and emits accepted + 1 tokens."""

from __future__ import annotations

import statistics
import time

import torch


def modeled_speedup(accepted: float, k: int, drafter_bytes: int, target_bytes: int) -> float:
    """Tokens per decode-step cost of speculative decode on the HBM roofline (the module doc)."""
    return (accepted + 1.0) / (1.0 + k * drafter_bytes / target_bytes)


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000.0


def _one_run(engine, drafter, prompt: list[int], new_tokens: int, k: int) -> dict:
    from harness.port.decode import generate, speculative

    n = len(prompt)
    prefill = _ms(lambda: engine.prefill(prompt))
    found = {}
    plain = _ms(lambda: found.update(plain=generate(engine, [prompt], new_tokens)[0])) - prefill
    spec = _ms(lambda: found.update(run=generate(engine, [prompt], new_tokens, speculative(drafter, k))[0])) - prefill
    run = found["run"]
    decode = _ms(lambda: engine.decode_step(run.tokens[0], n))
    verify = _ms(lambda: engine.verify(run.tokens[:1] * (k + 1), n))
    hidden = torch.zeros(1, 1, engine.spec.hidden_size)
    draft = _ms(lambda: drafter.step(engine.embed(torch.tensor(run.tokens[:1]))[..., :engine.spec.hidden_size],
                                     hidden.to(engine.settings.torch_dtype), n))
    steps = max(new_tokens - 1, 1)
    return {"plain_ms_per_token": plain / steps, "speculative_ms_per_token": spec / steps,
            "accepted_per_verify": run.acceptance, "verifies": run.verifies, "decode_step_ms": decode,
            "verify_ms": verify, "draft_step_ms": draft, "tokens_equal": run.tokens == found["plain"].tokens}


def time_speculative_batch(engine, drafter, prompts: list, new_tokens: int, *, k: int, runs: int) -> dict:
    """`bench --batch B --speculate K`: `runs` timed speculative decodes of the B prompts as one batch
    (the one decode loop, a KV slot each): ms per generated token (median run over all rows' tokens),
    accepted drafts per verify over every sequence's verifies and per sequence, and whether every
    sequence's tokens equal its plain greedy decode in the same batch."""
    from harness.port.decode import generate, speculative

    plain = generate(engine, prompts, new_tokens)
    found, samples = {}, []
    for _ in range(runs):
        samples.append(_ms(lambda: found.update(out=generate(engine, prompts, new_tokens, speculative(drafter, k)))))
    out = found["out"]
    verifies = sum(r.verifies for r in out)
    return {"k": k, "accepted_per_verify": sum(sum(r.accepted) for r in out) / verifies if verifies else 0.0,
            "verifies": verifies, "per_sequence": [r.acceptance for r in out],
            "ms_per_token": statistics.median(samples) / (len(prompts) * new_tokens),
            "tokens_equal": all(a.tokens == b.tokens for a, b in zip(out, plain)), "samples_ms": samples}


def bench_speculative(checkpoint, settings, assistant, k: int, *, runs: int, new_tokens: int, prompt: list[int]) -> dict:
    """The `speculative` block of a bench result (module doc); `assistant` an AssistantCheckpoint."""
    from harness.backends import build_drafter
    from harness.inputs.spec import dtype_bytes
    from harness.perf.bench import perf_engine
    from harness.port.sharding import bytes_per_rank

    engine = perf_engine(checkpoint, settings.but(speculate=k, assistant=str(assistant.path)),  # verify (neuron: draft) graphs
                         assistant=assistant)
    drafter = build_drafter(engine, assistant)
    _one_run(engine, drafter, prompt, new_tokens, k)  # warm-up
    samples = [_one_run(engine, drafter, prompt, new_tokens, k) for _ in range(runs)]
    med = {key: statistics.median(s[key] for s in samples) for key in samples[0] if key != "tokens_equal"}
    target_bytes = bytes_per_rank(checkpoint.spec, settings.tp, settings.dtype)["weights"]
    drafter_bytes = assistant.spec.bytes_per_rank(settings.tp, dtype_bytes(settings.dtype))
    return {"k": k, "runs": runs, "new_tokens": new_tokens, "prompt_len": len(prompt), **med,
            "measured_speedup": med["plain_ms_per_token"] / med["speculative_ms_per_token"],
            "verify_over_decode": med["verify_ms"] / med["decode_step_ms"],
            "draft_over_decode": med["draft_step_ms"] / med["decode_step_ms"],
            "drafter_bytes_per_rank": drafter_bytes, "target_weight_bytes_per_rank": target_bytes,
            "modeled_speedup_inf2": modeled_speedup(med["accepted_per_verify"], k, drafter_bytes, target_bytes),
            "tokens_equal": all(s["tokens_equal"] for s in samples), "samples": samples}


def speculative_block(checkpoint, settings, assistant, k: int | None, *, runs: int, new_tokens: int) -> dict:
    """`bench --assistant DIR --speculate K`'s {"speculative": block} on the bench prompt of the
    smallest bucket; {} without an assistant."""
    if assistant is None:
        return {}
    from harness.perf.bench import bench_prompt

    prompt = bench_prompt(checkpoint.spec.vocab_size, min(settings.buckets))
    return {"speculative": bench_speculative(checkpoint, settings, assistant, k, runs=runs, new_tokens=new_tokens,
                                             prompt=prompt)}
