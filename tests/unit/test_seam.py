"""One home for each decision of a check (issue 26, item 3; docs/design.md "One home for each
decision"): the prompt-fit rule shared by the commands and the library, one tie helper with one
ULP basis for tokens, routers and the served build, one departure classifier (edges included),
and the forcing loop, the routing verdict and the classifiers each called from one place."""

from __future__ import annotations

import ast
import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import harness
from harness.judge.compare import BF16, FP32, NEAR_TIE_ULPS
from harness.judge.tokens import classify_departure, classify_mismatch, saturation_tie, tie_threshold
from harness.base.errors import PromptError
from harness.base.numerics import bf16_ulp
from harness.inputs.prompts import check_kv_fit, kv_positions_used, validate_prompt_fit
from harness.judge.routing import RouterDecisions, judge_decisions
from harness.parity.served import judge_served
from harness.judge.stage_result import Ties

PACKAGE = Path(harness.__file__).parent


# ---- one prompt-fit rule ----------------------------------------------------------------------------

@pytest.mark.parametrize("n, new, fits", [(16, 0, True), (17, 0, False), (16, 1, True), (17, 1, False),
                                          (15, 2, True), (16, 2, False)])
def test_the_fit_rule_counts_the_positions_written(n, new, fits):
    assert kv_positions_used(n, new) == n + max(new, 1) - 1
    if fits:
        validate_prompt_fit([[1] * n], new, "p.json", buckets=(16,), kv_len=16)
    else:
        with pytest.raises(PromptError, match="--kv-len is 16"):
            validate_prompt_fit([[1] * n], new, "p.json", buckets=(16,), kv_len=16)


def test_the_fit_rule_counts_the_draft_rows_of_speculation():
    """The last verify, at position n + new - 2, is padded to k + 1 rows; one new token runs no verify."""
    assert kv_positions_used(20, 10, 3) == 20 + 10 - 2 + 3 + 1 == 32
    assert kv_positions_used(20, 1, 3) == kv_positions_used(20, 1) == 20
    check_kv_fit(20, 10, 32, draft=3)
    with pytest.raises(PromptError, match="with drafts of 3 .* exceed the KV length 32"):
        check_kv_fit(20, 11, 32, draft=3)


# a run's count of KV positions written again beside kv_positions_used: what a second copy looks like
FIT_COPIES = ["if p.numel() + want > self.engine.kv_len + 1: pass",
              "if n + new_tokens > engine.kv_len + 1: pass",
              "if prompt_len + new_tokens + k - 1 > kv_len: pass",
              "if max(buckets) + new_tokens > kv_len: pass",
              "ok = [x for x in lengths if x + args.new_tokens <= settings.kv_len]"]


def _fit_copies(tree) -> list[int]:
    """Lines comparing a count of new tokens with a KV length, other than through kv_positions_used."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        parts = list(ast.walk(node))
        names = {n.id for n in parts if isinstance(n, ast.Name)} | {n.attr for n in parts if isinstance(n, ast.Attribute)}
        if (any("kv_len" in n for n in names) and any("new_tokens" in n or n in ("want", "wants", "new") for n in names)
                and "kv_positions_used" not in names):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("copy", FIT_COPIES)
def test_the_fit_scan_finds_a_second_copy(copy):
    assert _fit_copies(ast.parse(copy))


def test_every_guard_counts_kv_positions_with_the_one_fit_function():
    """The engine, a batch, speculation, bench and the commands: none counts prompt + new tokens
    (+ drafts) against the KV length itself (the one count is inputs/prompts.py kv_positions_used)."""
    copies = {path.relative_to(PACKAGE.parent).as_posix(): lines for path in PACKAGE.rglob("*.py")
              if path.name != "prompts.py" and (lines := _fit_copies(ast.parse(path.read_text())))}
    assert copies == {}
    assert {"harness/cli/perf.py", "harness/perf/bench.py", "harness/perf/length.py", "harness/port/speculate.py"
            } <= _calls("kv_positions_used")
    assert {"harness/port/engine.py", "harness/port/decode.py"} <= _calls("check_kv_fit")


def test_the_fit_rule_checks_buckets_and_max_positions():
    with pytest.raises(PromptError, match="bucket 32 exceeds --kv-len 16"):
        validate_prompt_fit([[1] * 4], 1, "p.json", buckets=(8, 32), kv_len=16)
    with pytest.raises(PromptError, match="max_position_embeddings 12"):
        validate_prompt_fit([[1] * 10], 3, "p.json", kv_len=64, max_positions=12)


@pytest.fixture(scope="module")
def edge_references(tiny0_dir):
    """The tiny model's references for a prompt of 16 and one of 17 tokens, at 0 new tokens."""
    from harness.reference.run import run_reference

    refs = run_reference(tiny0_dir, [list(range(3, 19)), list(range(3, 20))], 0)
    return {n: ([refs["float32"][k]], [refs["bfloat16"][k]]) for k, n in enumerate((16, 17))}


def _engine(tiny0_ckpt):
    from harness.backends import build_engine
    from harness.base.settings import RunSettings

    return build_engine(tiny0_ckpt, RunSettings(buckets=(16,), kv_len=16), capture=True)


def test_the_library_refuses_what_the_command_refuses_before_the_port_runs(tiny0_ckpt, edge_references, monkeypatch):
    """At 0 new tokens a prompt of kv_len + 1 tokens is bad input for `check_port` too (it used to
    be accepted and then fail inside the port): PromptError, and the port never ran."""
    from harness.parity.check import check_port
    from harness.port import decode as port_decode

    def no_port(*args, **kwargs):
        raise AssertionError("the port ran on a prompt that does not fit")

    monkeypatch.setattr(port_decode, "generate", no_port)
    with pytest.raises(PromptError, match="prompt 0 has 17 tokens.*--kv-len is 16"):
        check_port(tiny0_ckpt, _engine(tiny0_ckpt), *edge_references[17])


def test_the_library_accepts_a_prompt_of_kv_len_tokens_at_0_new_tokens(tiny0_ckpt, edge_references):
    from harness.parity.check import check_port

    result = check_port(tiny0_ckpt, _engine(tiny0_ckpt), *edge_references[16], local=False)
    # the port ran and was judged: the fp32 stage passes and the bf16 stage judged every layer (its
    # host-probability verdict at one 16-row prompt is issue 26's item 1, not the fit rule's)
    assert result.bf16.port_error is None and result.fp32.passed, result.fp32.failures()
    assert len(result.bf16.layers) == tiny0_ckpt.spec.num_layers and all(layer.passed for layer in result.bf16.layers)


def test_the_command_refuses_a_prompt_of_kv_len_plus_one_at_0_new_tokens(tiny0_dir, tmp_path, capsys):
    prompts = tmp_path / "edge.json"
    prompts.write_text(json.dumps([list(range(3, 20))]))
    assert harness_main(["check", "--checkpoint", str(tiny0_dir), "--prompts", str(prompts), "--new-tokens", "0",
                         "--buckets", "16", "--kv-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "prompt 0 has 17 tokens" in err and "--kv-len is 16" in err


def harness_main(argv):
    from harness.cli import main

    return main(argv)


# ---- one tie helper, one ULP basis ----------------------------------------------------------------------

def test_the_ulp_floor_is_the_rows_largest_magnitude():
    row = torch.tensor([0.3, 0.2, -20.0])  # top-1 0.3 (ULP 2^-9), largest magnitude 20 (ULP 2^-3)
    assert tie_threshold(0.0, row) == NEAR_TIE_ULPS * bf16_ulp(20.0) == 0.5
    assert tie_threshold(0.7, row) == 0.7 and tie_threshold(0.0, row, ulp_floor=False) == 0.0
    # a flip of 0.1 is within four roundings of the row's scale: a near tie
    assert classify_mismatch(0, row, 1).kind == "near_tie" and classify_mismatch(0, row, 1).threshold == 0.5


def test_tokens_and_routers_tie_by_the_same_threshold():
    """The same row, band and margin: the token classifier and the router judge agree."""
    ref = torch.tensor([[0.3, 0.2, -20.0, -21.0]])
    token = classify_mismatch(0, ref[0], 1, band=0.0)
    weights = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # top-1 routing took expert 1 over expert 0
    routing = judge_decisions([RouterDecisions("layers.0.expert_weights", weights, ref, ref.clone())], 1,
                              lambda name, row: f"row {row}")
    flip = routing.flips[0]
    assert routing.band == 0.0 and flip.threshold == token.threshold and flip.kind == token.kind == "near_tie"


# ---- one departure classifier, edges included ---------------------------------------------------------------

def _ref(tokens, rows):
    rows = torch.tensor(rows)
    return SimpleNamespace(prompt=[1], generated=tokens, step_logits=rows,
                           captures={"step_capped_logits": 30 * torch.tanh(rows / 30)})


def _free(tokens, rows):
    return SimpleNamespace(tokens=tokens, step_logits=torch.tensor(rows))


REF_ROWS = [[5.0, 4.99, 0.0], [0.0, 0.0, 6.0]]
DEPARTURES = {
    "same": ([0, 2], REF_ROWS, None),
    "near tie": ([1, 2], [[5.0, 5.01, 0.0], [0.0, 0.0, 6.0]], "near_tie"),
    "divergence": ([0, 0], [[5.0, 4.99, 0.0], [6.0, 0.0, 0.0]], "divergence"),
    "not its own argmax": ([1, 2], REF_ROWS, "unexplained"),
    "shorter": ([0], REF_ROWS[:1], "unexplained"),
    "longer": ([0, 2, 2], REF_ROWS + [[0.0, 0.0, 6.0]], "unexplained"),
}


@pytest.mark.parametrize("case", list(DEPARTURES))
def test_served_departures_are_the_checks(case):
    tokens, rows, kind = DEPARTURES[case]
    ref = _ref([0, 2], REF_ROWS)
    checked = classify_departure(ref, _free(tokens, rows), 0.05, judge=BF16)
    prompts, _, _ = judge_served([_free(tokens, rows)], [ref], [ref], None, Ties(BF16, 0.05))
    served = prompts[0].departure
    assert (checked and checked.kind) == (served and served.kind) == kind
    if kind is not None:
        assert (served.position, served.evidence) == (checked.position, checked.evidence)
        assert prompts[0].accounted == (kind == "near_tie")


def test_a_saturation_tie_is_the_same_for_both():
    rows = [[900.0, 899.0, 0.0]]
    ref = _ref([0], rows)
    free = _free([1], [[899.0, 900.0, 0.0]])
    assert saturation_tie(ref.captures["step_capped_logits"][0], 1)
    assert classify_departure(ref, free, 0.0, judge=FP32).kind == "saturation_tie"
    assert judge_served([free], [ref], [ref], None, Ties(FP32, 0.0))[0][0].departure.kind == "saturation_tie"


def test_the_teacher_forced_choice_is_checked_when_there_is_one():
    ref = _ref([0, 2], REF_ROWS)
    free = _free([1, 2], [[5.0, 5.01, 0.0], [0.0, 0.0, 6.0]])
    forced = SimpleNamespace(step_logits=torch.tensor(REF_ROWS))  # teacher-forced, the same prefix picks 0
    verdict = classify_departure(ref, free, 0.05, forced=forced)
    assert verdict.kind == "unexplained" and math.isnan(verdict.margin) and "teacher-forced gives 0" in verdict.evidence


# ---- each decision called from its one home ---------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _callers() -> dict[str, set[str]]:
    """Per function name, the modules of the package that call it (by name or attribute)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                found.setdefault(name, set()).add(path.relative_to(PACKAGE.parent).as_posix())
    return found


def _calls(name: str) -> set[str]:
    return _callers().get(name, set())


@pytest.mark.parametrize("name, homes", [
    ("rerun_reference", {"harness/parity/observe.py"}),  # the references re-run along the port's path: observe only
    ("follow_routing", {"harness/parity/observe.py"}),
    ("add_pins", {"harness/parity/observe.py"}),
    ("judge_routing", {"harness/judge/stage.py"}),  # the stage judge judges routing; parity does not
    ("compare_layers", {"harness/judge/stage.py"}),  # local reads the stage's judged layers
    ("classify_departure", {"harness/judge/stage.py", "harness/parity/served.py",
                            "harness/snapshot/host_replay.py"}),  # a tokens host step's replay judges as the check
    ("classify_mismatch", {"harness/judge/tokens.py"}),  # the drafter's cluster choices: judged as routing
    ("saturation_tie", {"harness/judge/tokens.py"}),
    ("calibrate_band", {"harness/judge/tokens.py", "harness/judge/routing.py"}),
    # issue 45: one rule decides a departing choice on the port's own path, for tokens and routers alike
    ("own_path_choice", {"harness/judge/tokens.py", "harness/judge/routing.py"}),
    # transformers' router alone on the port's router input: the bf16 stage (observe) and the local verdicts
    ("router_alone", {"harness/parity/observe.py", "harness/parity/local.py"}),
    ("tie_threshold", {"harness/judge/tokens.py", "harness/judge/routing.py",
                       "harness/snapshot/host_repro.py"}),  # a tokens repro's per-step thresholds, as data
    # the one routing-forcing rule: the routes read from a run's captures, followed by the reference
    ("follow_routes", {"harness/parity/forced_path.py", "harness/quality/moe.py", "harness/reference/forcing.py",
                       "harness/parity/layer_alone.py"}),  # a layer alone's routes: local, bit-exact, snapshot bits
    ("chosen_experts", {"harness/reference/forcing.py", "harness/judge/routing.py",  # routing.py: judging only
                        "harness/snapshot/record.py"}),  # a snapshot's recorded routes, to name a replay's other routing
    ("validate_prompt_fit", {"harness/parity/observe.py", "harness/reference/golden_write.py", "harness/cli/check.py",
                             "harness/cli/bisect.py", "harness/cli/reference.py"}),
])
def test_each_decision_has_one_home(name, homes):
    assert _calls(name) == homes


def test_quality_says_why_it_does_not_take_the_per_layer_input_pins():
    from harness.quality.judge import forcing_notes

    assert forcing_notes(SimpleNamespace(moe=None, per_layer_input_size=0)) == []
    ple = forcing_notes(SimpleNamespace(moe=None, per_layer_input_size=256))
    assert len(ple) == 1 and "per-layer-input pins not taken" in ple[0]
    moe = forcing_notes(SimpleNamespace(moe=SimpleNamespace(top_k=2), per_layer_input_size=0))
    assert len(moe) == 1 and "follow_routes" in moe[0]


# ---- one decode loop ------------------------------------------------------------------------------------

# The device steps a decode loop is made of: Engine.decode_rows / verify_rows and their one-row forms.
STEP_CALLS = ("decode_step", "verify", "decode", "decode_rows", "verify_rows")
# the speculative bench's probes of one decode, one verify call (single calls, not a loop); bench,
# its lengths and its batches time the one loop itself (harness/perf/timing.py)
STEP_TIMERS = {"harness/perf/speculative.py"}
# one recorded host step run again (a snapshot of the step that raised), not a loop over steps
STEP_REPLAYS = {"harness/snapshot/host_raises.py"}


def _step_callers(files: dict[str, str]) -> set[str]:
    """The modules (path -> source) calling a device step of a decode loop."""
    found = set()
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STEP_CALLS:
                receiver = ast.unparse(node.func.value)
                if receiver == "self":  # the engine's one-row forms of its own calls, not a loop
                    continue
                if node.func.attr != "decode" or "engine" in receiver or receiver in ("be", "batch"):
                    found.add(path)
    return found


def test_a_second_decode_loop_is_found():
    copy = "for pos in range(first, n):\n    rows.append(engine.decode_step(window[pos], pos).logits)\n"
    assert _step_callers({"a module of quality": copy}) == {"a module of quality"}
    batched = "out = be.decode(tokens, positions, slots)\n"
    assert _step_callers({"a module of parity": batched}) == {"a module of parity"}
    rows = "out = engine.decode_rows(tokens, positions, slots)\n"
    assert _step_callers({"a module of perf": rows}) == {"a module of perf"}


def test_one_decode_loop_serves_single_batched_and_speculative_runs():
    """harness/port/decode.py `generate` is the only decode loop: the engine and speculation keep
    their one-call steps, and nothing else in the package steps a decode."""
    from harness.port import speculate
    from harness.port.engine import Engine

    files = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert _step_callers(files) - STEP_TIMERS - STEP_REPLAYS == {"harness/port/decode.py"}
    assert not hasattr(Engine, "generate")
    assert not hasattr(speculate, "speculative_generate")
    assert {"harness/parity/batched.py", "harness/parity/served.py",
            "harness/parity/speculative.py", "harness/quality/moe.py"} <= _calls("generate")



# ---- one engine ------------------------------------------------------------------------------------------

def _engines(files: dict[str, str]) -> set[str]:
    """(module, class) of every class in `files` (path -> source) that drives a backend: one calling
    `backend.forward` (other than a stand-in for the backend, which defines `forward` itself) or
    holding prefill, decode or verify steps of its own."""
    steps = {"prefill", "prefill_rows", "decode", "decode_rows", "decode_step", "verify", "verify_rows"}
    found = set()
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            forwards = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "forward"
                           and ast.unparse(c.func.value).endswith("backend") for c in ast.walk(node))
            if (forwards and "forward" not in methods) or len(methods & steps) >= 2:
                found.add(f"{path}:{node.name}")
    return found


ENGINE_COPIES = ["class BatchEngine:\n    def prefill(self, prompts, seq_ids): ...\n    def decode(self, tokens, positions, seq_ids): ...\n",
                 "class Slots:\n    def go(self, x):\n        return self.engine.backend.forward(x, None)\n"]


def test_the_engine_is_the_only_engine_and_a_second_is_found():
    """harness/port/engine.py `Engine` is the one engine: batch 1 is one KV slot of it (issue 47),
    so no second class drives a backend's calls or keeps prefill/decode/verify steps of its own
    (a batch engine, a slots wrapper); a planted one fails."""
    files = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert _engines(files) == {"harness/port/engine.py:Engine"}
    for copy in ENGINE_COPIES:
        assert _engines({"a module of port": copy}) == {"a module of port:" + copy.split()[1].rstrip(":")}, copy


# ---- bench times the one loop ------------------------------------------------------------------------------

CLOCKS = ("perf_counter", "monotonic", "time", "perf_counter_ns", "process_time")


def _clock_readers(files: dict[str, str]) -> set[str]:
    """The modules (path -> source) reading a clock (time.perf_counter() and its kin), or defining
    a `forward` (a stand-in for the backend, timing or not)."""
    found = set()
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS \
                    and ast.unparse(node.func.value) == "time":
                found.add(path)
            if isinstance(node, ast.FunctionDef) and node.name == "forward":
                found.add(path)
    return found


BENCH_LOOP_COPIES = ["start = time.perf_counter()\nlogits = engine.decode_step(token, n).logits\n",
                     "class _TimedBackend:\n    def forward(self, *args):\n        return self._backend.forward(*args)\n"]


def test_bench_times_the_one_loop_through_the_tap_and_a_second_timing_loop_is_found():
    """bench, its lengths and its batches keep no timing loop and no backend stand-in of their own
    (issue 47): they run the one decode loop through harness/perf/timing.py `timed_generate`, which
    reads the time at the loop's per-token callback and through the tap on the backend
    (harness/backends/tap.py). In perf/ only timing.py, the speculative probes and machine.py (this
    host's bandwidth and matmul rate, not the port) and environment.py (the wall time beside the CPU
    the machine spent on other work, which says whether two runs compare; not the port) read a clock."""
    perf = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in (PACKAGE / "perf").rglob("*.py")}
    assert _clock_readers(perf) == {"harness/perf/timing.py", "harness/perf/speculative.py", "harness/perf/machine.py",
                                    "harness/perf/environment.py"}
    assert {"harness/perf/bench.py", "harness/perf/length.py", "harness/perf/batch.py"} <= _calls("timed_generate")
    assert _calls("tap") == {"harness/perf/timing.py"}
    for copy in BENCH_LOOP_COPIES:
        assert _clock_readers({"a module of perf": copy}) == {"a module of perf"}, copy

# ---- builds: one home, the assistant opened once ----------------------------------------------------------

def _opens(files: dict[str, str], cls: str) -> set[str]:
    """The modules (path -> source) calling `cls.open(...)`."""
    return {path for path, source in files.items() for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "open"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == cls}


def test_the_assistant_is_opened_once_and_every_engine_is_built_by_the_backends():
    """The command opens --assistant once (cli/check.py's validation, for check and bench) and hands the
    AssistantCheckpoint to the speculative stage, the perf builds and a backend drafting on its device;
    only a library caller's neuron build without it opens it there. Every Engine is made in
    harness/backends (build_engine) or over a recorded backend (a host step's replay)."""
    files = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert _opens(files, "AssistantCheckpoint") == {"harness/cli/check.py", "harness/backends/neuron_drafter.py"}
    assert _opens({"a module of perf": "drafter = build_drafter(engine, AssistantCheckpoint.open(path, spec))"},
                  "AssistantCheckpoint") == {"a module of perf"}
    assert _calls("Engine") == {"harness/backends/__init__.py", "harness/snapshot/host_replay.py"}
    assert _calls("make_backend") == {"harness/backends/__init__.py", "harness/parity/observe.py"}  # + a layer backend


# ---- one stage protocol ----------------------------------------------------------------------------------

def test_every_stage_returns_a_stage_result_whose_failures_its_gates_compute_once():
    """Every stage of a check (fp32 and bf16 included) is a StageResult: their own failures()/to_json/
    passed rules are gone (the protocol computes the failures from the gates once and writes them)."""
    from harness.judge.results import ParityStage
    from harness.judge.stage_result import StageResult
    from harness.parity.batched import BatchStage
    from harness.parity.served import ServedResult
    from harness.parity.speculative import SpeculativeStage

    from harness.judge.distribution import Distribution
    from harness.parity.host_rows import PerLayerRowsStage

    for cls in (ParityStage, ServedResult, BatchStage, SpeculativeStage, Distribution, PerLayerRowsStage):
        assert issubclass(cls, StageResult)
        assert not {"failures", "to_json", "passed"} & set(vars(cls)), cls.__name__
    assert _calls("run_stages") == {"harness/parity/check.py"}  # only the parity run executes stages
    assert _calls("overall_verdict") == {"harness/judge/check_result.py"}  # one function builds the verdict
    assert _calls("divergent") >= {"harness/judge/stage_result.py"}


def _stage_protocols(files: dict[str, str]) -> set[str]:
    """The classes (module:class) writing a stage's verdict their own way: a `failures` method taking
    no argument beyond self, or a `stage_passed` property, other than StageResult's (and the check's
    result, which reads its stages' failures)."""
    found = set()
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and (
                            item.name == "stage_passed" or item.name == "failures" and len(item.args.args) == 1):
                        found.add(f"{path}:{node.name}")
    return found


PROTOCOL_COPIES = ["class CheckStage:\n    def failures(self):\n        return []",
                   "class Stage32:\n    @property\n    def stage_passed(self):\n        return True"]


def test_fp32_and_bf16_are_stages_run_by_the_one_runner_and_the_verdict_reads_one_list():
    """The fp32 and bf16 stages are Stages like the others (parity_stages), executed by run_stages into
    the check's one list of sealed stages; overall_verdict takes that list and nothing else; a second
    verdict protocol (a class with its own failures() or stage_passed) is found."""
    import inspect

    from harness.judge.stage_result import overall_verdict
    from harness.parity.check import parity_stages

    assert [s.name for s in parity_stages(None, local=None, fp32_engine="auto", layer_backend=None)] == ["fp32", "bf16"]
    assert [s.name for s in parity_stages(None, local=None, fp32_engine=None, layer_backend=None)] == ["bf16"]
    assert list(inspect.signature(overall_verdict).parameters) == ["stages"]
    files = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert _stage_protocols(files) == {"harness/judge/stage_result.py:StageResult",
                                       "harness/judge/check_result.py:CheckResult"}
    for copy in PROTOCOL_COPIES:
        assert _stage_protocols({"a module": copy}) == {"a module:" + copy.split()[1].rstrip(":")}, copy


def _stage_adders(files: dict[str, str]) -> set[str]:
    """The modules (path -> source) adding a stage to a check result's stages (append, extend, insert,
    +=, or assigning the list), or deciding a stage's strictness after it ran (`.strict = `)."""
    found = set()
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("append", "extend", "insert") and ast.unparse(node.func.value).endswith(".stages"):
                found.add(path)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            if any(isinstance(t, ast.Attribute) and t.attr in ("stages", "extra_stages", "strict") for t in targets):
                found.add(path)
    return found


# a stage added by hand beside run_stages, or strictness decided after the run: what a second copy looks like
STAGE_COPIES = ["result.stages.append(judge_distribution(result))",
                "result.stages += judge_per_layer_rows(checkpoint, engine, refs)",
                "check.stages = [fp32, bf16, dist, served]",
                "check.extra_stages = [dist, served]",
                "found.strict = strict"]


def test_only_run_stages_adds_a_stage_and_a_second_copy_is_found():
    files = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert _stage_adders(files) == {"harness/parity/stages.py"}
    for copy in STAGE_COPIES:
        assert _stage_adders({"a module of parity": copy}) == {"a module of parity"}, copy


def test_the_stage_order_is_declared_and_held_by_run_stages():
    """The stages on the parity build run first and it is released after the last of them; a stage
    reading another runs after it and is given its result (the distribution reads the served build's)."""
    from harness.judge.check_result import CheckResult
    from harness.judge.stage_result import Stage
    from harness.parity.batched import BatchStage
    from harness.parity.stages import run_stages, stage_order

    ran = []

    def stage(name, **kw):
        def run(**inputs):
            ran.append((name, sorted(inputs), inputs.get("served") is not None))
            return BatchStage(ran=False, notes=[name]) if name != "none" else None
        return Stage(name, run, **kw)

    stages = [stage("distribution", reads=("run",), after=("served",)), stage("served"), stage("none"),
              stage("rows", reads=("run", "engine"))]
    inputs, result = {"run": None, "checkpoint": None, "engine": object()}, CheckResult("cpu", 1, "bfloat16")
    run_stages(stages, inputs, into=result)
    assert [r[0] for r in ran] == ["rows", "served", "distribution", "none"]  # each as soon as its reads ran
    assert ran[2] == ("distribution", ["run", "served"], True) and "engine" not in inputs
    assert [s.notes[0] for s in result.stages] == ["rows", "served", "distribution"]  # None: none
    with pytest.raises(ValueError, match="read each other"):
        stage_order([stage("a", after=("b",)), stage("b", after=("a",))])
    with pytest.raises(ValueError, match="after it was released"):
        stage_order([stage("served"), stage("rows", reads=("engine",), after=("served",))])
    with pytest.raises(ValueError, match="reads \\['references'\\]"):
        run_stages([stage("x", reads=("references",))], {"run": None}, into=CheckResult("cpu", 1, "bfloat16"))


def test_strict_precision_is_a_parameter_of_the_distribution_stage():
    from harness.parity.check import check_stages

    names = [s.name for s in check_stages()]
    assert names == ["per_layer_rows", "bitwise_layers", "distribution"]
    assert next(s for s in check_stages() if s.name == "distribution").after == ("fp32", "bf16", "served", "bitwise_layers")
    assert "strict_precision" not in _callers()  # no function decides it after the run


def test_a_gate_added_to_a_stage_counts_in_its_verdict_and_json():
    """The extension point (a later gate, e.g. a distributional one): add_gate before the seal."""
    from harness.judge.check_result import CheckResult
    from harness.judge.stage_result import Gate, overall_verdict
    from harness.parity.batched import BatchStage

    stage = BatchStage(ran=False, notes=["stand-in"])
    stage.add_gate(Gate("distribution", [{"stage": "batch", "point": "distribution", "where": "prompt 0"}],
                        {"statistic": 0.5}))
    stage.seal()
    with pytest.raises(RuntimeError, match="sealed"):
        stage.add_gate(Gate("late"))
    payload = stage.to_json()
    assert not stage.passed and payload["passed"] is False and payload["gates"][0]["statistic"] == 0.5
    result = CheckResult(backend="cpu", tp=1, dtype="bfloat16", stages=[stage])
    verdict = overall_verdict(result.stages)
    assert not verdict.passed and verdict.failed_stages == ["batch"] and verdict.failures[0]["point"] == "distribution"
    assert result.to_json()["first_failure"]["point"] == "distribution"


def test_a_tie_band_travels_with_its_judge():
    from harness.judge.compare import BF16, FP32
    from harness.judge.stage_result import ties

    calibration = SimpleNamespace(band=4.0)
    assert ties(BF16, calibration) == Ties(BF16, 4.0)
    assert ties(FP32, calibration) == Ties(FP32, 0.0)  # the bf16 band is never paired with the fp32 judge
    assert ties(BF16, None).band == 0.0


# ---- one "port layer alone" runner ---------------------------------------------------------------------------

# A rank module's state a layer run alone sets by hand: its cache, the keys it reads, its KV slots, its
# per-layer inputs, and the decoder's own run_layers. The port (the decoder, its graphs) and the backends
# (whose calls run the whole decoder) own them; harness/parity/layer_alone.py runs one layer alone.
LAYER_STATE = ("run_layers", "reset_cache", "set_kv_read", "set_seq_ids")
LAYER_ALONE_HOMES = ("harness/port/", "harness/backends/", "harness/parity/layer_alone.py")


def _layer_drivers(files: dict[str, str]) -> set[str]:
    """The modules (path -> source) calling a rank module's layer-state methods or setting its
    per-layer inputs: each a place that drives a layer (or the decoder) by hand."""
    found = set()
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LAYER_STATE:
                found.add(path)
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "_per_layer_inputs" for t in targets):
                found.add(path)
    return found


LAYER_ALONE_COPIES = ["module.reset_cache()\nmodule.run_layers(rows[None], positions, i, i + 1, captures)\n",
                      "backend.ranks[rank].set_kv_read(None)\n",
                      "host._per_layer_inputs = per_layer[None]\n",
                      "module.set_seq_ids(None)\n"]


def test_one_runner_drives_a_port_layer_alone_and_a_second_is_found():
    """The local verdicts, the bit-exact stage and its snapshot, `replay --layer` and the repro's
    traced layer all run one port layer through harness/parity/layer_alone.py (issue 47): nothing
    else outside the port and the backends sets a module's cache, keys read, slots or per-layer
    inputs, or calls run_layers; and "this layer's routes" is read there once (layer_routes)."""
    files = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}
    drivers = {p for p in _layer_drivers(files) if not p.startswith(LAYER_ALONE_HOMES[:2])}
    assert drivers == {"harness/parity/layer_alone.py"}
    assert {"harness/parity/local.py", "harness/parity/layer_bits.py", "harness/snapshot/bits.py",
            "harness/snapshot/replay.py", "harness/snapshot/traced_layer.py"} <= (
        _calls("port_layer_captures") | _calls("port_layer_exact") | _calls("port_layer_on_cache") | _calls("run_layer"))
    assert _calls("layer_routes") == {"harness/parity/local.py", "harness/parity/layer_bits.py",
                                      "harness/snapshot/bits.py"}
    for copy in LAYER_ALONE_COPIES:
        assert _layer_drivers({"a module of snapshot": copy}) == {"a module of snapshot"}, copy


# ---- one sealing mechanism for goldens and snapshots ---------------------------------------------------------

SEALING_CALLS = ("sha256_file", "save_file", "load_file", "safe_open")


def _sealers(files: dict[str, str]) -> set[str]:
    """The modules (path -> source) hashing, saving or loading a tensor file themselves, or hashing a
    manifest (json.dumps with sort_keys): what harness/inputs/sealed.py does for goldens and snapshots."""
    found = set()
    for path, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in SEALING_CALLS or (name == "dumps" and any(k.arg == "sort_keys" for k in node.keywords)):
                found.add(path)
    return found


SEALING_COPIES = ["manifest['tensors_sha256'] = sha256_file(tmp / TENSORS)\n", "tensors = load_file(str(file))\n",
                  "blob = json.dumps(body, sort_keys=True, separators=(',', ':')).encode()\n"]


def test_goldens_and_snapshots_are_sealed_by_one_module_and_a_second_is_found():
    """Goldens and snapshots are written, hashed, sealed and read back by harness/inputs/sealed.py
    (issue 47): no golden or snapshot module saves, loads or hashes its files or its manifest itself."""
    from harness.reference.golden import GOLDEN
    from harness.snapshot.fields import SNAPSHOT

    files = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text()
             for path in [*PACKAGE.glob("reference/golden*.py"), *PACKAGE.glob("snapshot/*.py")]}
    assert len(files) > 10 and _sealers(files) == set()
    assert type(GOLDEN) is type(SNAPSHOT) and GOLDEN.seal_key != SNAPSHOT.seal_key
    for copy in SEALING_COPIES:
        assert _sealers({"a module of snapshot": copy}) == {"a module of snapshot"}, copy
