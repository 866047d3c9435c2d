"""The port's own layer traced for the standalone repro (harness.snapshot.repro) and its HLO bundle:
per rank of the snapshot's TP plan, the rank's shard of the layer (and, for a KV-shared layer, of
its source layer) hosted by its decoder's own run_layers (masks, rope, cache writes) and run alone
by harness.parity.layer_alone, traced by torch.jit once per device call the engine made, so it
loads with torch alone.

What the device holds as state and what the ranks exchange become explicit inputs and outputs:
- the KV cache: `k`, `v` in, the cache after the call out (the script carries it to the next call);
- each all-reduce: the rank's partial out, the reduced sum in (the script sums every rank's
  partials in fp32 in rank order, as the port's collectives do, and runs the call again until every
  reduction has seen its true sum: one pass more than there are reductions).
A call's traced method fixes its KV bucket (the read length the backend chose for it) and shapes."""

from __future__ import annotations

import types
import warnings

import torch
from torch import nn

from harness.port import model as port_model
from harness.port.model import Collectives, RankLinears


class PartialSums(Collectives):
    """all_reduce for the repro: the partial is recorded as an output, the sum comes in as an input."""

    def __init__(self):
        self.sums: list[torch.Tensor] = []
        self.partials: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.partials)
        self.partials.append(x)
        return self.sums[k].to(x.dtype) if k < len(self.sums) else x


class RankHost(nn.Module):
    """One rank's hosted layers (the failing layer, after its KV source when it has one) in the
    slots of their own indices: to harness.parity.layer_alone a decoder of one sequence whose one
    cache comes in as inputs (never zeroed here) and whose keys read are the call's KV bucket."""

    def __init__(self, decoder_cls, spec, layers: dict[int, nn.Module], *, index: int, parts: list[str],
                 collectives: PartialSums):
        super().__init__()
        self.spec, self.index, self.parts, self.collectives = spec, index, parts, collectives
        self.hosted = sorted(layers)
        self.layers = nn.ModuleList([layers.get(j, layers[index]) for j in range(index + 1)])
        self._decoder_run = decoder_cls.run_layers  # the decoder's own code, run on this host's layers
        layer_input = decoder_cls.__dict__.get("layer_input")
        self.layer_input = layer_input.__func__ if isinstance(layer_input, staticmethod) else layer_input
        self.cache = layers[self.hosted[0]].self_attn.cache  # the one cache the hosted layers use
        self.dtype = self.cache.k.dtype

    def run_layers(self, x, positions, start: int, stop: int, captures=None):
        return self._decoder_run(self, x, positions, start, stop, captures=captures)

    def set_seq_ids(self, seq_ids) -> None:
        self.cache.seq_ids = seq_ids

    def set_kv_read(self, length: int | None) -> None:
        self.cache.read_len = length

    def forward(self, xs, positions, ples, k, v, *sums):
        """xs [hosted, 1, s, hidden] (each hosted layer's input), ples [hosted, 1, s, P] or empty,
        the cache (k, v), the reductions' sums -> the failing layer's parts, the partials, the cache."""
        from harness.parity.layer_alone import run_layer

        self.collectives.sums, self.collectives.partials = list(sums), []
        self.cache.k, self.cache.v = k, v
        read = self.cache.read_len  # the call's KV bucket, set by its traced method (_call_method)
        captures: dict = {}
        for slot, j in enumerate(self.hosted):
            per_layer = None
            if ples.numel():
                per_layer = torch.zeros(*ples.shape[1:3], self.index + 1, ples.shape[-1],
                                        dtype=ples.dtype, device=ples.device)  # traced, ples stays a graph input
                per_layer[:, :, j] = ples[slot]
            captures.update(run_layer(self, j, xs[slot], positions, fresh=False, kv_read=read,
                                      per_layer=per_layer))
        parts = tuple(captures[f"layers.{self.index}.{p}"].float() for p in self.parts)
        return parts + tuple(self.collectives.partials) + (self.cache.k, self.cache.v)


def port_source(spec, index: int) -> int | None:
    """The layer whose cache the port's layer `index` reads, as the port's decoder decides it
    (FamilyRankDecoder.source_of; None: the layer's own cache)."""
    from harness.port.blocks import FamilyRankDecoder

    layer = spec.layers[index]
    return None if layer.kv_source is None else FamilyRankDecoder.source_of(types.SimpleNamespace(spec=spec), layer)


def rank_hosts(checkpoint, settings, index: int, parts: list[str]) -> list[RankHost]:
    """Every rank's host of layer `index` (and its KV source) at the run's TP, dtype and KV length."""
    from harness.port.blocks import FamilyRankDecoder
    from harness.port.model import RankDecoder
    from harness.port.quantized import QuantizedLinears
    from harness.port.sharding import plan_model, shard_layer
    from harness.snapshot.record import layer_weights

    spec, dtype, tp = checkpoint.spec, settings.torch_dtype, settings.tp
    quantize = getattr(settings, "quantize", None)  # the int8 port's own projections, traced as it runs them
    linears = RankLinears if quantize is None else QuantizedLinears
    decoder_cls = FamilyRankDecoder if spec.uses_family_blocks else RankDecoder
    plans = plan_model(spec, tp)
    source = port_source(spec, index)
    wanted = [index] if source is None else [source, index]
    weights = {j: layer_weights(checkpoint, j, dtype, quantize) for j in wanted}
    hosts = []
    for rank in range(tp):
        collectives, layers = PartialSums(), {}
        for j in wanted:
            layer = decoder_cls.layer_class(spec, spec.layers[j], plans[j], linears(collectives),
                                            max_len=settings.kv_len, dtype=dtype)
            if spec.layers[j].kv_source is None:  # the module's make_cache, looked up as the decoder does
                layer.self_attn.cache = port_model.make_cache(settings.sliding_cache, spec.layers[j],
                                                              plans[j].kv_heads_per_rank, settings.kv_len, dtype)
            layer.load_state_dict(shard_layer(weights[j], plans[j], rank), strict=True)
            layers[j] = layer.to(dtype).eval()
        if source is not None:
            layers[index].self_attn.bind(layers[source].self_attn)
        hosts.append(RankHost(decoder_cls, spec, layers, index=index, parts=parts, collectives=collectives))
    return hosts


def _call_method(read_len: int):
    def method(self, *args):
        self.cache.read_len = read_len  # a Python int: the call's KV bucket, fixed in its graph
        return self.forward(*args)

    return method


def trace_rank(host: RankHost, calls: list[dict]) -> tuple[torch.jit.ScriptModule, list[list]]:
    """`host` traced once per call (method call{j}); each call's reductions as [shape, dtype]."""
    counts, inputs = [], {}
    for j, call in enumerate(calls):
        setattr(host, f"call{j}", types.MethodType(_call_method(call["read_len"]), host))
        args = (call["xs"], call["positions"], call["ples"], *host_cache(host))
        with torch.no_grad():
            out = getattr(host, f"call{j}")(*args)  # a dry run: how many reductions, of which shapes
        partials = out[len(host.parts):-2]
        counts.append([[list(p.shape), str(p.dtype).removeprefix("torch.")] for p in partials])
        inputs[f"call{j}"] = args + tuple(torch.zeros_like(p) for p in partials)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the static branches are this call's shapes
        traced = torch.jit.trace_module(host, inputs, check_trace=False)
    return traced, counts


def host_cache(host: RankHost) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero cache of the host's shape (what every call starts from before the first)."""
    return torch.zeros_like(host.cache.k), torch.zeros_like(host.cache.v)
