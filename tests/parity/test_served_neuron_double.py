"""The served build on the Neuron backend, through the NxD contract double (tests/nxd_double):
`check` builds the perf build as `bench` does (no captures, last real row only, the cache not
zeroed on reset), runs it, passes on the healthy tiny port and fails naming the served build when
only the perf graph is wrong."""

from __future__ import annotations

import json

import pytest

from harness.backends import neuron_env
from tests.nxd_double import installed
from tests.parity import served_faults

pytestmark = pytest.mark.slow  # `check` through the NxD double: the slow lane, as in test_neuron_double

PROMPTS = [[2, 17, 93, 41, 250, 8, 77], [2] + list(range(30, 53))]


@pytest.fixture
def nxd(tmp_path, monkeypatch):
    """The double, and a fresh artifact cache per test: a patched graph must not reuse the healthy
    build's artifacts (the cache key hashes the model source, not a monkeypatch)."""
    monkeypatch.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "neuron-cache"))
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setattr(neuron_env, "neuron_core_count", lambda: 16)  # where the core assignment counts them
    with installed(monkeypatch):
        yield


def _check(tmp_path, extra=()):
    from harness.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "check.json"
    rc = main(["check", "--model", "tiny", "--backend", "neuron", "--prompts", str(prompts), "--new-tokens", "3",
               "--buckets", "32", "--kv-len", "64", "--skip-fp32-stage", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_healthy_served_build_passes_through_check(nxd, tmp_path):
    rc, payload = _check(tmp_path)
    served = payload["extra_stages"]["served"]
    assert rc == 0, payload["first_failure"]
    assert served["ran"] and served["passed"] and served["last_row_only"] and not served["same_code_as_parity_build"]
    assert [p["tokens"] for p in served["prompts"]] == [p["device_tokens"] for p in payload["prompts"]]


def test_last_row_gather_off_by_one_in_the_perf_graph_fails_check_naming_the_served_build(nxd, tmp_path, monkeypatch):
    served_faults.last_row_gather_off_by_one(monkeypatch)
    rc, payload = _check(tmp_path)
    assert rc == 1
    assert payload["failed_stages"] == ["served"] and payload["stages"]["bf16"]["passed"]
    assert payload["first_failure"]["stage"] == "served"
    assert payload["first_failure"]["point"].startswith("served build")
