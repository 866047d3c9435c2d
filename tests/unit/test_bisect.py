"""Truncate-mode bisection: the binary search over builds of the first k layers finds the first
failing prefix within ceil(log2 L) + 1 builds, builds each prefix once, names the component with
the attention-only build, and on the real CPU backend agrees with capture mode."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.backends import build_engine
from harness.parity.bisect import (
    PrefixCheckpoint,
    backend_prefix_build,
    bisect_truncate,
    first_failing_prefix,
    run_bisect,
)
from harness.base.settings import RunSettings
from harness.inputs.checkpoint import Checkpoint
from harness.parity.local import intra_op_threads_for
from harness.port.model import rms_norm
from harness.reference.golden import read_golden
from harness.reference.golden_write import write_golden
from harness.reference.run import ReferenceResult, run_reference

HIDDEN = 8


def search_budget(num_layers: int) -> int:
    return math.ceil(math.log2(num_layers)) + 1 if num_layers > 1 else 1


@pytest.mark.parametrize("num_layers", range(1, 65))
def test_first_failing_prefix_within_budget(num_layers):
    """For every first failing prefix (and none), the search returns it after at most
    ceil(log2 L) + 1 probes, each prefix probed at most once."""
    for first in list(range(1, num_layers + 1)) + [None]:
        probes = []

        def fails(k):
            probes.append(k)
            return first is not None and k >= first

        assert first_failing_prefix(num_layers, fails) == first
        assert len(probes) <= search_budget(num_layers), (first, probes)
        assert len(set(probes)) == len(probes)


def _spec_with_layers(spec, num_layers: int):
    layers = tuple(replace(spec.layers[i % spec.num_layers], index=i) for i in range(num_layers))
    return replace(spec, layers=layers, hidden_size=HIDDEN)


def _synthetic_golden(spec, prompt_lengths=(5, 9)):
    """fp32 golden captures at every layer's attention residual and output, and a bf16 run that
    differs from it by bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    ref32, ref16 = [], []
    for n in prompt_lengths:
        caps = {f"layers.{i}.{point}": torch.randn(n, HIDDEN, generator=gen)
                for i in range(spec.num_layers) for point in ("attn_residual", "output")}
        ref32.append(ReferenceResult(list(range(1, n + 1)), "float32", caps))
        ref16.append(ReferenceResult(list(range(1, n + 1)), "bfloat16",
                                     {k: v.bfloat16().float() for k, v in caps.items()}))
    return ref32, ref16


class CountingBuild:
    """A fake device build: prefixes before the faulty layer read out the golden's values (through
    bf16, as the device would), later ones are off by a large error; the faulty layer's attention
    residual is off only when the fault is in attention. Counts every build."""

    def __init__(self, ref32, first_bad: int | None, component: str, eps: float):
        self.ref32, self.first_bad, self.component, self.eps = ref32, first_bad, component, eps
        self.calls: list[tuple[int, str]] = []

    def __call__(self, k: int, part: str):
        self.calls.append((k, part))
        layer = k - 1
        broken = self.first_bad is not None and (
            layer > self.first_bad or (layer == self.first_bad and (part == "layer" or self.component == "attention")))
        point = "attn_residual" if part == "attention" else "output"
        by_prompt = {tuple(r.prompt): r.captures[f"layers.{layer}.{point}"] for r in self.ref32}

        def run(prompt):
            x = by_prompt[tuple(prompt)]
            if broken:
                x = x + 0.3 * x.std() * torch.randn(x.shape, generator=torch.Generator().manual_seed(k))
            return rms_norm(x.bfloat16(), None, self.eps).float()

        return run


@pytest.mark.parametrize("num_layers", [1, 2, 5, 12, 48])
def test_truncate_search_with_counting_fake_build(tiny0_ckpt, num_layers):
    """For every first bad layer in 0..L-1 and for none, truncate mode reports that layer and the
    fault's component; the layer search takes at most ceil(log2 L) + 1 builds, naming the
    component one more, and no (k, part) is built twice."""
    spec = _spec_with_layers(tiny0_ckpt.spec, num_layers)
    ref32, ref16 = _synthetic_golden(spec)
    for first_bad in list(range(num_layers)) + [None]:
        for component in ("attention", "mlp"):
            build = CountingBuild(ref32, first_bad, component, spec.rms_norm_eps)
            result = bisect_truncate(spec, ref32, ref16, build)
            assert result.first_divergent_layer == first_bad
            assert result.component == (component if first_bad is not None else None)
            searched = [c for c in build.calls if c[1] == "layer"]
            assert len(searched) <= search_budget(num_layers), (first_bad, build.calls)
            assert len(build.calls) - len(searched) == (first_bad is not None)
            assert len(set(build.calls)) == len(build.calls) == result.builds
            if first_bad is None:
                break


@pytest.fixture(scope="session")
def long_prompt_golden(tmp_path_factory, tiny0_dir, tiny0_ckpt, default_prompts):
    """A golden of the original tiny checkpoint for the longest default prompt that fits a 64-token
    bucket (past the sliding window), prefill only."""
    prompt = max((p for p in default_prompts if len(p) <= 64), key=len)
    with intra_op_threads_for(tiny0_ckpt.spec):  # the tiny model runs faster on one thread
        refs = run_reference(tiny0_dir, [prompt], new_tokens=0)
    out = tmp_path_factory.mktemp("truncate") / "golden"
    write_golden(out, tiny0_ckpt.spec, refs, 0, tiny0_ckpt.file_hashes(), str(tiny0_dir))
    return read_golden(out, expected_spec=tiny0_ckpt.spec)


def test_prefix_readout_is_normalized_hidden_state(tiny0_ckpt, default_prompts):
    """A build of the first k layers reads out exactly rms_norm of layer k-1's output (and, with
    the MLP silenced, of its attention residual) as the full port computes them."""
    prompt, k = default_prompts[1], 6
    settings = RunSettings(buckets=(64,), kv_len=64)
    full = build_engine(tiny0_ckpt, settings).prefill(prompt, capture=True).captures
    eps, hidden = tiny0_ckpt.spec.rms_norm_eps, tiny0_ckpt.spec.hidden_size
    for part, point in (("layer", "output"), ("attention", "attn_residual")):
        engine = build_engine(PrefixCheckpoint(tiny0_ckpt, k, part), settings)
        readout = engine.prefill(prompt).logits
        expected = rms_norm(full[f"layers.{k - 1}.{point}"].bfloat16(), None, eps).float()
        torch.testing.assert_close(readout[:, :hidden], expected, rtol=0, atol=0)
        assert torch.count_nonzero(readout[:, hidden:]) == 0


def test_truncate_on_cpu_backend_agrees_with_capture(tmp_path, tiny0_dir, long_prompt_golden):
    """A checkpoint copy with noise in layer 3's MLP: truncate mode on the real CPU backend finds
    layer 3 and mlp, like capture mode, within ceil(log2 12) + 1 builds counted at the backend."""
    ckpt = Checkpoint.open(_mlp_perturbed_copy(tiny0_dir, tmp_path / "ckpt", layer=3))
    capture = run_bisect(ckpt, long_prompt_golden, mode="capture")
    built = []
    real_build = backend_prefix_build(ckpt, RunSettings(buckets=(64,), kv_len=64))

    def counting_build(k, part):
        built.append((k, part))
        return real_build(k, part)

    truncate = run_bisect(ckpt, long_prompt_golden, mode="truncate", build=counting_build)
    assert (capture.first_divergent_layer, capture.component) == (3, "mlp")
    assert (truncate.first_divergent_layer, truncate.component) == (3, "mlp")
    assert truncate.builds == len(built) == len(set(built)) <= search_budget(ckpt.spec.num_layers)
    assert truncate.first_failing_prefix == 4 and truncate.to_json()["layers"]


def _mlp_perturbed_copy(src, out, layer: int):
    ckpt = Checkpoint.open(src)
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    key = ckpt.layer_key(layer, "mlp.up_proj.weight")
    w = tensors[key]
    tensors[key] = w + 0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
