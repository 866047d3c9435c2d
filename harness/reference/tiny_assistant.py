"""Tiny assistant (drafter) checkpoints for the tiny targets, built through transformers' own
assistant classes, then fitted to their target for a while so that drafts are often accepted (a
random drafter's acceptance is ~0, and a judge of acceptance needs something to lose).

The fit is a few hundred Adam steps on the target's own greedy continuations of random prompts:
the assistant is run exactly as transformers' assisted generation runs it (target's scaled
embedding of the last token + the target's last hidden state, the target's store-layer keys and
values up to the drafting position, the position held constant), trained on cross entropy against
the target's next token (its full head, its masked head's clusters) and on its post-projection
against the target's next hidden state. Deterministic from the seed; cached like harness.inputs.tiny."""

from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path

import torch

from harness import FIXTURES_DIR
from harness.base.errors import CheckpointError, read_json_file
from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY, _save_atomically, cache_dir, randomize_for_margins, tiny_checkpoint
from harness.reference.assistant import load_target

TINY_ASSISTANT_VERSION = 1
# target config -> its tiny assistant's config
TINY_ASSISTANTS = {TINY_CONFIG: FIXTURES_DIR / "configs" / "tiny" / "gemma-4-tiny-assistant.json",
                   TINY_FAMILY["31b"]: FIXTURES_DIR / "configs" / "tiny" / "gemma-4-tiny-31b-assistant.json"}
FIT_PROMPTS, FIT_PROMPT_LEN, FIT_NEW_TOKENS, FIT_STEPS = 32, 6, 20, 120


def assistant_class(config: dict):
    import transformers

    unified = config["model_type"] == "gemma4_unified_assistant"
    prefix = "Gemma4UnifiedAssistant" if unified else "Gemma4Assistant"
    return getattr(transformers, prefix + "Config"), getattr(transformers, prefix + "ForCausalLM")


def _continuations(target, vocab: int, gen: torch.Generator):
    """Greedy continuations of random prompts: (ids [B, L], last hidden [B, L, H], store KV)."""
    prompts = torch.randint(3, vocab, (FIT_PROMPTS, FIT_PROMPT_LEN), generator=gen)
    with torch.no_grad():
        ids = target.generate(prompts, max_new_tokens=FIT_NEW_TOKENS, min_new_tokens=FIT_NEW_TOKENS, do_sample=False)
        out = target(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    return ids, out.hidden_states[-1], out.shared_kv_states


def draft_once(assistant, embeds, hidden, position: int, shared_kv):
    """One assistant call at `position` on keys [0, position): (logits, post-projected state)."""
    kv = {k: (v[0][:, :, :position], v[1][:, :, :position]) for k, v in shared_kv.items()}
    out = assistant(inputs_embeds=torch.cat([embeds, hidden], dim=-1), position_ids=torch.full((embeds.shape[0], 1), position),
                    shared_kv_states=kv, use_cache=False)
    return out.logits, out.last_hidden_state


def fit_assistant(assistant, target, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = assistant.config.get_text_config().vocab_size
    ids, hidden, shared_kv = _continuations(target, vocab, gen)
    embed = target.get_input_embeddings()
    masked = assistant.masked_embedding
    opt = torch.optim.Adam([p for n, p in assistant.named_parameters() if "token_ordering" not in n], lr=3e-3)
    positions = list(range(FIT_PROMPT_LEN, ids.shape[1] - 1))
    for step in range(FIT_STEPS):
        p = positions[step % len(positions)]
        with torch.no_grad():
            e = embed(ids[:, p:p + 1])
        kv = {k: (v[0][:, :, :p], v[1][:, :, :p]) for k, v in shared_kv.items()}
        x = assistant.pre_projection(torch.cat([e, hidden[:, p - 1:p]], -1))
        last = assistant.model(inputs_embeds=x, position_ids=torch.full((ids.shape[0], 1), p), shared_kv_states=kv,
                               use_cache=False).last_hidden_state
        state = assistant.post_projection(last)
        label = ids[:, p + 1]
        loss = torch.nn.functional.cross_entropy(assistant.lm_head(last)[:, 0], label)
        loss = loss + torch.nn.functional.mse_loss(state[:, 0], hidden[:, p])
        if masked is not None:
            cluster = torch.argsort(masked.token_ordering)[label] // (vocab // masked.num_centroids)
            loss = loss + torch.nn.functional.cross_entropy(masked.centroids(last)[:, 0], cluster)
        opt.zero_grad()
        loss.backward()
        opt.step()


def build_tiny_assistant(out_dir, target_dir, config_path, seed: int = 0) -> Path:
    """A fitted tiny assistant for the target at `target_dir`, saved with save_pretrained."""
    config = read_json_file(Path(config_path), "assistant config", CheckpointError, "")
    config.pop("architectures", None)
    config_cls, model_cls = assistant_class(config)
    torch.manual_seed(seed)
    assistant = model_cls(config_cls(**config))
    randomize_for_margins(assistant, seed)
    if assistant.masked_embedding is not None:  # transformers leaves the ordering zero: a permutation
        order = torch.randperm(assistant.config.get_text_config().vocab_size, generator=torch.Generator().manual_seed(seed))
        assistant.masked_embedding.token_ordering.copy_(order)
    target = load_target(Path(target_dir))
    fit_assistant(assistant, target, seed)
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    _save_atomically(assistant, Path(out_dir), False)
    return Path(out_dir)


def tiny_assistant(seed: int = 0, target_config: Path = TINY_CONFIG) -> tuple[Path, Path]:
    """(target, assistant) checkpoint directories of a tiny pair, built and cached on first use."""
    target = tiny_checkpoint(seed, target_config)
    config = TINY_ASSISTANTS[target_config]
    digest = hashlib.sha256(config.read_bytes() + target.name.encode() +
                            f"assistant-{TINY_ASSISTANT_VERSION}".encode()).hexdigest()[:10]
    path = cache_dir() / f"{config.stem}-{digest}-seed{seed}"
    if (path / "config.json").is_file():
        return target, path
    with open(cache_dir() / f".lock-{path.name}", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            build_tiny_assistant(path, target, config, seed)
    return target, path
