"""Fixtures of the quantization suite: the tiny 12B's quantized model (its structural reference)
and its references on two short prompts, the quantized models' goldens (tests/quant/matrix.py),
computed once per session, and the NxD contract double installed (tests/nxd_double)."""

from __future__ import annotations

import pytest

SHORT_PROMPTS = [[2, 17, 33, 4, 9, 71, 5], [2, 8, 100, 42, 7, 13, 3, 88, 21, 6, 11]]
NEW_TOKENS = 4
QUICK = {"buckets": (16,), "kv_len": 32}  # settings that hold SHORT_PROMPTS and NEW_TOKENS


@pytest.fixture(scope="session")
def int8_ckpt(tiny0_ckpt):
    from harness.inputs.quantized_checkpoint import quantized_reference

    return quantized_reference(tiny0_ckpt, "int8")


@pytest.fixture(scope="session")
def int8_reference(int8_ckpt):
    from harness.reference.run import run_reference

    return run_reference(int8_ckpt.path, SHORT_PROMPTS, new_tokens=NEW_TOKENS)


@pytest.fixture(scope="session")
def int8_golden(tmp_path_factory):
    """golden(model): the quantized model's golden of SHORT_PROMPTS, written once per session."""
    from tests.quant.matrix import write_golden

    written = {}

    def golden(model: str):
        if model not in written:
            written[model] = write_golden(model, tmp_path_factory.mktemp(f"int8-{model}"))
        return written[model]

    return golden


@pytest.fixture(scope="module")
def nxd(tmp_path_factory):
    """The neuron backend runnable here: the NxD contract double installed, an inf2.8xlarge's cores."""
    from harness.backends import neuron_env
    from tests.nxd_double import installed

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path_factory.mktemp("neuron-cache")))
        mp.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
        mp.setenv("GEMMA_PARITY_INSTANCE_TYPE", "inf2.8xlarge")
        mp.setattr(neuron_env, "neuron_core_count", lambda: 16)
        with installed(mp):
            yield
