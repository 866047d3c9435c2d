"""The pull-request lane's selection (`pytest -m smoke`, .github/workflows/pr.yml): a few minutes on
a GitHub-hosted two-core runner that still touch every layer of the project: the static rules
(layers, sizes, call style, workflows), the port checked on the cpu backend and through the NxD
double (the backend kinds a CPU runner has), one fault of each kind caught where it is (the fault
catalog's default lane), the input contract (exit codes, hostile inputs, interrupts, atomic
outputs) and the quality golden's sharding. Listed here, in one place, instead of a marker in
each file: the root conftest.py marks these tests `smoke` at collection."""

from __future__ import annotations

SMOKE = (
    # static rules: every module placed in its layer, sizes, call style, the workflows' structure
    "tests/unit/test_layering.py::", "tests/unit/test_module_size.py::", "tests/unit/test_call_style.py::",
    "tests/unit/test_workflows.py::", "tests/unit/test_doc_references.py::",
    # spec, sharding plan, numerics: the layers under the port
    "tests/unit/test_spec.py::", "tests/unit/test_settings.py::",
    # the port on the cpu backend and through the NxD double, and the check that judges it
    "tests/faults/test_fault_catalog.py::test_clean_port_passes",
    "tests/faults/test_fault_catalog.py::test_fault_is_caught_where_it_is",
    "tests/unit/test_nxd_double.py::",
    # the input contract
    "tests/inputs/test_contract.py::", "tests/inputs/test_hostile_quality.py::",
    "tests/inputs/test_exit_contract_streams.py::",
    # sharding over machines
    "tests/quality/test_quality_shards.py::test_shard_auto",
)


def mark_smoke(items) -> None:
    import pytest

    for item in items:
        if item.nodeid.startswith(SMOKE):
            item.add_marker(pytest.mark.smoke)
