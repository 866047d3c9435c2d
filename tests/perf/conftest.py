"""Bench results the tests write record a quiet machine: the tests that bench and then compare check
the wiring and the decision rule, and must not turn "not comparable" (exit 2) because the machine the
tests run on is busy (harness/perf/environment.py). The measurement itself, and the rule on busy
machines, are tested on faked kernel counters and recorded results (test_comparable_runs.py)."""

from __future__ import annotations

import functools

import pytest


@pytest.fixture(scope="session", autouse=True)
def _bench_records_a_quiet_machine():
    from harness.perf import environment

    measured = environment.since

    @functools.wraps(measured)
    def quiet(start):
        return {**measured(start), "others_cpu": 0.0, "steal": 0.0, "cpu_stall": 0.0}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(environment, "since", quiet)
        yield
