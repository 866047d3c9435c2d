"""The resource plan (`info --plan`, harness/plan/host_plan.py): per command host peak, device bytes per
core and graphs, for the 12B, 31B and 26B-A4B, from a config like `info`."""

from __future__ import annotations

import json

import pytest

from harness import FIXTURES_DIR
from harness.cli import EXIT_BAD_INPUT, EXIT_OK, main
from harness.inputs.spec import load_spec
from harness.plan.host_plan import (COMMANDS, host_parts, host_peak, host_phases, fp32_model_bytes, resource_plan,
                                    what_fits)
from harness.plan.instances import core_bytes

CONFIGS = FIXTURES_DIR / "configs"
GIB = 1 << 30


@pytest.mark.parametrize("name, tp, instance", [("12b", 2, "inf2.8xlarge"), ("31b", 8, "inf2.24xlarge"),
                                                ("26b-a4b", 4, "inf2.24xlarge")])
def test_the_plan_of_each_command(name, tp, instance):
    spec = load_spec(CONFIGS / f"gemma-4-{name}-it.json")
    plan = resource_plan(spec, tp, "bfloat16", 256, (64, 256), batch=None)  # a check with its batch stage
    core = core_bytes(spec, tp, "bfloat16", 256, buckets=(64, 256))  # the parity build: captures
    perf = core_bytes(spec, tp, "bfloat16", 256, buckets=(64, 256), perf=True)  # served and bench: a row each
    assert plan["instance"] == instance and set(plan["commands"]) == set(COMMANDS)
    batch_stage = core_bytes(spec, tp, "bfloat16", 256, buckets=(64, 256), batch=4)
    assert perf["total"] < core["total"] < batch_stage["total"]
    for cmd, c in plan["commands"].items():
        assert c["graphs"] == sum(c["graphs_by_stage"].values())
        if cmd == "reference":  # the references run on the host: nothing compiled
            assert c["graphs"] == 0 and c["device_bytes_per_core"] == 0 and c["fits_device"]
        elif cmd == "check":  # parity 7, the batch stage's 7 at batch buckets 1, 2, 4, served 7
            assert c["graphs_by_stage"] == {"parity build": 7, "batch stage": 21, "served build": 7}
            assert c["device_bytes_per_core"] == batch_stage["total"]
            assert c["fits_device"] == (batch_stage["total"] <= 16 * GIB) == (c["device_problem"] is None)
        else:  # bench compiles the perf build only; bisect and quality the parity build
            assert c["device_bytes_per_core"] == (perf if cmd == "bench" else core)["total"]
            assert c["graphs"] == core["graphs"] == 7 and c["fits_device"] == (c["device_bytes_per_core"] <= 16 * GIB)
        rounds = sum(-(-n // c["compile"]["workers"]) for n in c["graphs_by_stage"].values())  # a pool per build
        assert c["compile"]["minutes"] == rounds * c["compile"]["per_graph"] and c["compile"]["source"]
        assert c["host_peak_bytes"] == host_peak(cmd, c["host_phases"]) > max(c["host_phases"].values())
        assert c["fits_host"] == (c["host_peak_bytes"] <= plan["host_bytes"])
    assert plan["device_problem"] == plan["commands"]["check"]["device_problem"] or plan["commands"]["check"]["fits_device"]
    assert "batch stage" in plan["commands"]["check"]["host_phases"]
    alone = resource_plan(spec, tp, "bfloat16", 256, (64, 256), batch=1)  # on neuron without --batch: no batch stage
    assert "batch stage" not in alone["commands"]["check"]["host_phases"]
    assert "batch stage" not in alone["commands"]["check"]["graphs_by_stage"]
    # issue 28: every command, check included, fits the instance's host by the phase plan (the
    # float64 envelope streamed, one reference model at a time)
    assert all(c["fits_host"] for c in plan["commands"].values())
    assert plan["float64_streamed"] and max(plan["commands"]["check"]["host_phases"].items(),
                                            key=lambda kv: kv[1])[0] == "fp32 stage"


def test_the_12b_phases_count_what_each_holds_at_once():
    spec = load_spec(CONFIGS / "gemma-4-12b-it.json")
    parts = host_parts(spec, 2, "bfloat16", "neuron")
    model = fp32_model_bytes(spec)
    assert 7 * GIB < 8 * spec.vocab_size * spec.hidden_size <= parts["float64"] < 13 * GIB  # streamed, not 2 x 44.7
    assert parts["port"] == 2 * spec.vocab_size * spec.hidden_size  # neuron: the host keeps the bf16 embedding only
    phases = host_phases("check", parts)
    assert phases["reference"] >= parts["port"] + model
    assert phases["fp32 stage"] == parts["port"] + parts["fp32_port"] + parts["float64"] + parts["captures"]
    assert "reference" not in host_phases("check", parts, golden=True)
    assert "fp32 stage" not in host_phases("check", parts, fp32_stage=False)
    # the batch stage: its batched parity build, then a run as the bf16 stage's (--batch 1 drops it)
    assert phases["batch stage"] == parts["port"] + max(parts["load"], parts["captures"] + parts["rerun"])
    assert "batch stage" not in host_phases("check", parts, batch_stage=False)
    cpu = host_parts(spec, 2, "bfloat16", "cpu")
    assert cpu["port"] > parts["port"] + model // 2 - GIB  # cpu: the ranks live on the host too
    small = host_parts(load_spec(FIXTURES_DIR / "configs" / "gemma-4-tiny.json"), 2, "bfloat16", "cpu")
    assert not small["float64_streamed"] and small["float64"] == 2 * fp32_model_bytes(
        load_spec(FIXTURES_DIR / "configs" / "gemma-4-tiny.json"))


def test_what_makes_a_command_fit():
    spec = load_spec(CONFIGS / "gemma-4-12b-it.json")
    check = resource_plan(spec, 2, "bfloat16", 256, (64,), host_bytes=70 * GIB)["commands"]["check"]
    assert not check["fits_host"]
    plan = resource_plan(spec, 2, "bfloat16", 256, (64,), host_bytes=70 * GIB)
    assert what_fits(plan, "check").startswith("with --golden DIR and --skip-fp32-stage the plan is")
    assert "--stream" in what_fits(resource_plan(spec, 2, "bfloat16", 256, (64,), host_bytes=30 * GIB), "reference")
    hopeless = resource_plan(spec, 2, "bfloat16", 256, (64,), host_bytes=1 * GIB)
    assert what_fits(hopeless, "check").startswith("no option of check brings it under 1.0 GiB")


def test_the_12b_fp32_size_and_a_stated_budget():
    spec = load_spec(CONFIGS / "gemma-4-12b-it.json")
    assert 44 * GIB < fp32_model_bytes(spec) < 45 * GIB  # issue 28: 44.7 GiB
    roomy = resource_plan(spec, 2, "bfloat16", 256, (64,), host_bytes=512 * GIB)
    assert roomy["host_bytes"] == 512 * GIB and all(c["fits_host"] for c in roomy["commands"].values())
    tight = resource_plan(spec, 1, "bfloat16", 256, (64,))
    assert not tight["commands"]["bench"]["fits_device"] and "--tp 2" in tight["device_problem"]


def test_info_plan_json_carries_every_command(tmp_path, capsys):
    out = tmp_path / "info.json"
    args = ["info", "--config", str(CONFIGS / "gemma-4-12b-it.json"), "--tp", "2", "--plan"]
    assert main(args + ["--json", str(out)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "resource plan: inf2.8xlarge" in text and "check     host peak" in text
    commands = json.loads(out.read_text())["resource_plan"]["commands"]
    assert set(commands) == set(COMMANDS)
    assert all({"host_peak_bytes", "device_bytes_per_core", "graphs"} <= set(c) for c in commands.values())
    with pytest.raises(SystemExit) as exc:  # the same --host-memory as every other command's (argparse: exit 2)
        main(args + ["--host-memory", "0"])
    assert exc.value.code == EXIT_BAD_INPUT
    assert "'0': give the host budget in GiB (a positive number) or `auto`" in capsys.readouterr().err


def test_commands_refuse_a_run_over_the_host_budget_before_model_work(tmp_path, capsys, monkeypatch):
    import harness.parity.check as parity

    monkeypatch.setattr(parity, "run_parity_check", lambda *a, **k: pytest.fail("model work started"))
    assert main(["check", "--model", "tiny", "--host-memory", "0.2"]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out.startswith("check plan: host peak ") and "of 0.2 GiB (largest phase: fp32 stage)" in out
    assert "over the host budget of 0.2 GiB (--host-memory 0.2)" in err and "no option of check" in err
    assert main(["reference", "--model", "tiny", "--host-memory", "0.001", "--out", str(tmp_path / "g")]) == 2
    assert "reference: the host plan needs" in capsys.readouterr().err and not (tmp_path / "g").exists()
    with pytest.raises(SystemExit) as exc:  # argparse: a malformed command line exits 2
        main(["check", "--model", "tiny", "--host-memory", "nope"])
    assert exc.value.code == EXIT_BAD_INPUT
    assert "give the host budget in GiB (a positive number) or `auto`" in capsys.readouterr().err


def test_the_refusal_names_the_options_that_make_it_fit(capsys, monkeypatch):
    from harness.plan import host_plan

    # a budget between the plan with the references and the fp32 stage and the plan without them
    spec = load_spec(FIXTURES_DIR / "configs" / "gemma-4-tiny.json")
    parts = host_parts(spec, 2, "bfloat16", "cpu")
    full = host_peak("check", host_phases("check", parts))
    lean = host_peak("check", host_phases("check", parts, golden=True, fp32_stage=False))
    assert lean < full
    monkeypatch.setattr(host_plan, "_default_rows", lambda: 0)
    gib = (lean + full) / 2 / GIB
    code = main(["check", "--model", "tiny", "--host-memory", f"{gib:.6f}", "--new-tokens", "0",
                 "--prompts", str(FIXTURES_DIR / "prompts" / "default.json")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and "with --golden DIR" in err and "which fits" in err, err


def test_moe_references_rerun_along_the_port_path_in_the_bf16_stage():
    moe = host_parts(load_spec(CONFIGS / "gemma-4-26b-a4b-it.json"), 4, "bfloat16", "neuron")
    dense = host_parts(load_spec(CONFIGS / "gemma-4-12b-it.json"), 2, "bfloat16", "neuron")
    assert moe["rerun"] == moe["model"] and dense["rerun"] == 0
    assert host_phases("check", moe)["bf16 stage"] == moe["port"] + moe["captures"] + moe["model"]


def test_an_fp32_port_on_the_host_is_its_own_fp32_stage():
    spec = load_spec(CONFIGS / "gemma-4-12b-it.json")
    assert host_parts(spec, 2, "float32", "cpu")["fp32_port"] == 0
    assert host_parts(spec, 2, "float32", "neuron")["fp32_port"] > fp32_model_bytes(spec)  # built on cpu beside it


def test_the_speculative_stage_s_fp32_run_on_the_host_is_a_phase_of_check_and_bisect(tmp_path, capsys):
    """check --assistant --speculate K runs its speculative stage's fp32 build on the host (cpu, as the
    fp32 stage's: parity/speculative.speculative_settings) with its fp32 drafter, the assistant's fp32
    and bf16 references, then the fp32 target acceptance loads once that build is released: the host plan
    counts it as a phase of check and bisect, and info --plan prints it; without --assistant no such phase."""
    from harness.inputs.assistant_spec import load_assistant_spec

    spec = load_spec(CONFIGS / "gemma-4-tiny.json")
    assistant = load_assistant_spec(CONFIGS / "tiny" / "gemma-4-tiny-assistant.json", spec)
    parts = host_parts(spec, 2, "bfloat16", "neuron", assistant=assistant)
    drafters = 2 * assistant.bytes_per_rank(2, 4) + assistant.bytes_per_rank(1, 4) + assistant.bytes_per_rank(1, 2)
    assert parts["drafters"] == drafters > 0 and parts["fp32_port"] > 0
    plan = resource_plan(spec, 2, "bfloat16", 256, (16,), speculate=3, assistant=assistant)
    for cmd in ("check", "bisect"):
        phases = plan["commands"][cmd]["host_phases"]
        assert phases["speculative stage"] == (parts["port"] + drafters + max(parts["fp32_port"], parts["model"])
                                               + parts["captures"])
    assert all("speculative stage" not in plan["commands"][c]["host_phases"] for c in ("reference", "quality", "bench"))
    plain = resource_plan(spec, 2, "bfloat16", 256, (16,), speculate=3)
    assert "speculative stage" not in plain["commands"]["check"]["host_phases"]
    out, assistant_dir = tmp_path / "info.json", tmp_path / "assistant"
    assistant_dir.mkdir()  # info reads the assistant's config.json only
    (assistant_dir / "config.json").write_text((CONFIGS / "tiny" / "gemma-4-tiny-assistant.json").read_text())
    assert main(["info", "--model", "tiny", "--assistant", str(assistant_dir), "--speculate", "3", "--plan",
                 "--json", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    check = json.loads(out.read_text())["resource_plan"]["commands"]["check"]
    assert "speculative stage" in check["host_phases"]
    assert f"speculative stage {check['host_phases']['speculative stage'] / GIB:.1f} GiB" in printed
