"""The drafter on the XLA backend (docs/speculative.md#the-drafter): the same per-rank `RankDrafter`
as the cpu backend's, with XLA collectives, its weights stacked on a leading rank axis and sharded
over the XlaBackend's mesh like the target's, each draft step one SPMD program over both devices
(each device runs rank r's drafter inside a manual-sharding region, as the target's graphs run).

It has no cache: each layer reads the XlaBackend's device KV state tensor of the target's store
layer of its type, as a read-only input of the draft graph (no host copy, nothing written back:
the backend's state is never reassigned here). Static shapes: embeds [1, 1, H], state [1, 1, H],
position [1, 1] int32 (an input, so one compiled program serves every position); outputs the raw
logits [1, 1, vocab], the post-projection state and, on a parity build, the capture points. On a
batched build (a KV state of several slots) each draft step reads the slot of its sequence: the
slot is an int32 input selecting that sequence's keys and values from the state inside the
program (one program serves every slot, as one serves every position).
`lower_draft_graph` lowers one rank's draft graph (not executed) for the HLO contracts
(harness/hlo/contracts.py `check_draft_graph`)."""

from __future__ import annotations

import torch

from harness.backends.xla_env import XlaCollectives, xla_runtime
from harness.backends.xla_lower import LoweredGraph, _transfers, bound
from harness.base.errors import HarnessInputError
from harness.port.drafter import RankDrafter, rank_drafter_state
from harness.port.graphs import POSITION_DTYPE
from harness.port.model import RankLinears

DRAFT_TAG = "draft"
DRAFT_INPUTS = ("embeds", "hidden", "position")


def kv_state_names(aspec) -> list[tuple[str, str]]:
    """Per drafter layer, the (k, v) names of the XlaBackend state it reads: its store layer's cache."""
    return [tuple(f"layers.{layer.kv_source}.self_attn.cache.{b}" for b in ("k", "v")) for layer in aspec.layers]


def build_draft_module(aspec, tp: int, dtype: torch.dtype) -> RankDrafter:
    module = RankDrafter(aspec, tp, RankLinears(XlaCollectives(tp)), dtype)
    module.eval()
    module.requires_grad_(False)
    return module


def draft_forward(module: RankDrafter, embeds, hidden, position, kv, capture: bool) -> tuple[list, list[str]]:
    """The draft graph's body: ([logits, state, *captures], the captures' names, in the module's
    order). The int32 position is widened inside the graph, as TracedDecoder widens its positions."""
    logits, state, caps = module(embeds, hidden, position.to(torch.long), kv, capture)
    return [logits, state, *caps.values()], list(caps)


class XlaDrafter:
    """The assistant's drafter over an XlaBackend (harness.backends.build_drafter)."""

    serves_slots = True  # step(slot=): a batched build's sequences draft from their own KV slot

    def __init__(self, backend, assistant):
        self.backend, self.spec, self.rt = backend, assistant.spec, backend.rt
        self.module = build_draft_module(self.spec, backend.tp, backend.dtype)
        self.capture = backend.returns_captures  # a parity build's draft graph returns the capture points
        states = [rank_drafter_state(assistant.weights, self.spec, backend.tp, rank, backend.dtype)
                  for rank in range(backend.tp)]
        self.module.load_state_dict(states[0], strict=True)  # names and shapes checked once, on the host
        self.weights = {name: backend._global([s[name] for s in states]) for name in states[0]}
        del states
        self.kv_names = kv_state_names(self.spec)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, position: int, capture: bool = False, slot: int = 0):
        """One draft at `position` (keys [0, position) of the target's device cache of the sequence in
        `slot`): (logits [vocab] fp32, state [1, 1, H], captures name -> fp32 (empty unless asked))."""
        if capture and not self.capture:
            raise HarnessInputError("this is a perf build (no capture outputs in its draft graph); build the "
                                    "backend with capture=True for a parity build")
        be, device = self.backend, self.rt.device
        inputs = [embeds.to(be.dtype), hidden.to(be.dtype), torch.tensor([[position]], dtype=POSITION_DTYPE)]
        local = [be._local(t.contiguous().to(device), per_rank=False) for t in inputs]
        weights = {n: be._local(t, per_rank=True) for n, t in self.weights.items()}
        kv = [tuple(be._local(be.state[name], per_rank=True) for name in pair) for pair in self.kv_names]
        if be.slots > 1:  # the sequence's slot, selected in the program (an input: one program for every slot)
            if not 0 <= slot < be.slots:
                raise HarnessInputError(f"draft from KV slot {slot}: the build has slots 0..{be.slots - 1}")
            at = be._local(torch.tensor([slot], dtype=POSITION_DTYPE).to(device), per_rank=False).to(torch.long)
            kv = [tuple(t.index_select(0, at) for t in pair) for pair in kv]
        with bound(self.module, weights):
            outputs, names = draft_forward(self.module, *local, kv, self.capture)
        results = [be._to_global(o, per_rank=False) for o in outputs]
        self.rt.torch_xla.sync()
        logits, state, *caps = [r.cpu()[0] for r in results]
        return logits[0, -1].float(), state, ({n: v.float() for n, v in zip(names, caps)} if capture else {})

    def lower(self, rank: int = 0) -> LoweredGraph:
        return lower_draft_graph(self.module, self.backend, self.weights_of(rank), rank)

    def weights_of(self, rank: int) -> dict[str, torch.Tensor]:
        """One rank's drafter weights, on the host."""
        return {n: t.cpu()[rank if self.backend.tp > 1 else 0] for n, t in self.weights.items()}


def lower_draft_graph(module: RankDrafter, backend, weights: dict[str, torch.Tensor], rank: int = 0) -> LoweredGraph:
    """Trace one rank's draft graph on the XLA device (no execution): its HLO and signature, the
    weights as `weight` parameters, the target's KV state it reads as `target_kv` parameters (the
    contracts check that they are read only), the inputs as `input`."""
    rt = xla_runtime()
    xlac, device = rt.torch_xla._XLAC, rt.device
    aspec = module.aspec
    kv_names = kv_state_names(aspec)
    kv_shape = {name: tuple(backend.state[name].shape[1:]) for pair in kv_names for name in pair}  # one rank's
    hidden = aspec.backbone_hidden_size
    examples = {"embeds": torch.zeros(1, 1, hidden, dtype=backend.dtype), "hidden": torch.zeros(1, 1, hidden, dtype=backend.dtype),
                "position": torch.zeros(1, 1, dtype=POSITION_DTYPE)}
    named = {**{n: ("weight", t.to(device)) for n, t in weights.items()},
             **{n: ("target_kv", torch.zeros(s, dtype=backend.dtype).to(device)) for n, s in kv_shape.items()},
             **{n: ("input", t.to(device)) for n, t in examples.items()}}
    handles = xlac._get_tensors_handle([t for _, t in named.values()])
    by_handle = {h: (role, n) for h, (n, (role, _)) in zip(handles, named.items())}
    rt.metrics.clear_all()
    xlac._set_all_reduce_token(str(device), None)
    tensors = {n: t for n, (_, t) in named.items()}
    kv = [tuple(tensors[name] for name in pair) for pair in kv_names]
    with bound(module, {n: tensors[n] for n in weights}):
        results, captures = draft_forward(module, *(tensors[n] for n in DRAFT_INPUTS), kv, True)
    host_transfers = _transfers(rt.metrics)
    _, data = xlac._get_tensors_xla_device_data_node(results)
    params = [by_handle.get(h, ("scalar", f"literal{k}")) for k, h in enumerate(xlac._get_tensors_handle(data))]
    hlo = xlac._get_xla_tensors_hlo(results)
    xlac._set_all_reduce_token(str(device), None)
    return LoweredGraph(DRAFT_TAG, 1, rank, hlo, params=params, outputs=["logits", "state", *captures],
                        host_transfers=host_transfers)
