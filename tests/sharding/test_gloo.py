"""TP=2 as two processes in a torch.distributed gloo group gives the CPU backend's logits exactly.

The CPU backend runs its ranks as threads with an in-process all-reduce; this runs the same
per-rank RankDecoder in two real processes with gloo collectives, as a multi-process host would.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.backends.cpu import CpuBackend
from harness.base.settings import RunSettings
from harness.inputs.checkpoint import Checkpoint
from harness.port.engine import embed_scale
from harness.port.model import Collectives, RankDecoder, RankLinears
from harness.port.sharding import rank_state_dicts

WORLD_SIZE = 2
MAX_LEN = 32
RENDEZVOUS_TIMEOUT = timedelta(seconds=900)  # a hang guard: a loaded machine may start one rank minutes late


class GlooCollectives(Collectives):
    """Collectives over the default torch.distributed group (gloo).

    The all-reduce runs in fp32 and casts back, as NxD does with its default reduce_dtype and as
    the CPU backend's in-process group does (docs/design.md#backends: gloo has historically had no bf16 sum).
    """

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        total = x.float()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)


def _rank_main(rank: int, checkpoint_dir: str, rendezvous: str, inputs_path: str, out_dir: str):
    """One TP rank: join the gloo group, load this rank's shard, run one prefill, save logits."""
    torch.set_num_threads(1)  # two ranks on a two-core machine: no oversubscription
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=WORLD_SIZE, timeout=RENDEZVOUS_TIMEOUT)
    try:
        checkpoint = Checkpoint.open(checkpoint_dir)
        state = rank_state_dicts(checkpoint, WORLD_SIZE, torch.bfloat16)[rank]
        module = RankDecoder(checkpoint.spec, tp=WORLD_SIZE, max_len=MAX_LEN, dtype=torch.bfloat16,
                             linears=RankLinears(GlooCollectives()))
        module.load_state_dict(state, strict=True)
        module.eval()
        inputs = torch.load(inputs_path)
        with torch.no_grad():
            logits = module(inputs["inputs_embeds"], inputs["positions"])
        torch.save(logits, f"{out_dir}/logits_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _prefill_inputs(checkpoint, prompt):
    """Host embeddings of `prompt` in bf16, as the engine makes them, and absolute positions."""
    ids = torch.tensor(prompt)
    embed = checkpoint.embed_weight(torch.bfloat16)
    inputs_embeds = (embed[ids] * embed_scale(checkpoint.spec.hidden_size, torch.bfloat16))[None]
    return inputs_embeds, torch.arange(ids.numel())[None]


def test_gloo_two_process_tp2_equals_cpu_backend(tiny0_dir, tiny0_ckpt, default_prompts, tmp_path):
    """Two gloo processes, each a RankDecoder with its rank_state_dicts shard, give bit-identical
    bf16 logits to the in-process CpuBackend(tp=2, bf16), on both ranks.

    Exact equality, not a tolerance: every rank-local op is the same computation on the same
    shard, and with two ranks a fp32 all-reduce is the single addition a + b, which is commutative
    in IEEE arithmetic, so gloo's reduction order cannot differ from the backend's rank-order sum;
    the all-gather only concatenates. A prompt of 24 tokens crosses the sliding window (16).
    """
    prompt = default_prompts[1]
    assert MAX_LEN >= len(prompt) > tiny0_ckpt.spec.sliding_window
    inputs_embeds, positions = _prefill_inputs(tiny0_ckpt, prompt)
    inputs_path = tmp_path / "inputs.pt"
    torch.save({"inputs_embeds": inputs_embeds, "positions": positions}, inputs_path)
    # A rendezvous file per test: xdist workers never share a group.
    mp.spawn(_rank_main, nprocs=WORLD_SIZE, join=True,
             args=(str(tiny0_dir), str(tmp_path / "rendezvous"), str(inputs_path), str(tmp_path)))

    settings = RunSettings(tp=WORLD_SIZE, dtype="bfloat16", kv_len=MAX_LEN, buckets=(MAX_LEN,))
    expected, _ = CpuBackend(tiny0_ckpt, settings).forward(inputs_embeds, positions)
    for rank in range(WORLD_SIZE):
        logits = torch.load(tmp_path / f"logits_rank{rank}.pt")
        assert logits.dtype == torch.bfloat16 and logits.shape == expected.shape
        diff = (logits.float() - expected.float()).abs().max().item()
        assert torch.equal(logits, expected), f"rank {rank}: max |gloo - cpu backend| = {diff:.3e}"
