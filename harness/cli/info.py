"""`gemma-parity info`: the resolved per-layer spec, the TP plan and device bytes per rank."""

from __future__ import annotations

from harness.base.atomic import write_json_atomic
from harness.base.errors import HarnessInputError, OptionError
from harness.cli import validate as v
from harness.cli.common import EXIT_OK, add_model_args, add_run_args, run_settings, with_generator
from harness.cli.host_gate import add_host_memory_arg, budget
from harness.cli.output_paths import _json_is_ours, clean_leftovers, output_location, replaceable_file
from harness.report.fit import render_fit_table
from harness.report.perf_text import render_roofline


def add_command(sub) -> None:
    p = sub.add_parser("info", help="resolved per-layer spec, TP sharding plan and bytes per rank",
                       description="The resolved per-layer spec, the TP plan and device bytes per rank. "
                                   "Exit 0, or 2 on bad input.")
    add_model_args(p, config=True)
    add_run_args(p, fields=("tp", "dtype", "kv_len", "sliding_cache", "quantize"), purpose="device dtype of the memory estimate")
    tp = next(a for a in p._actions if a.dest == "tp")
    tp.default, tp.help = None, (f"tensor parallel degree (default: {tp.default} when the model fits one NeuronCore "
                                 "per rank there, else the smallest TP that fits)")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--batch", type=_batches_arg, default=(), metavar="1,2,4,8",
                   help="also the KV bytes and HBM fit of these batch sizes (a KV slot per sequence) at --kv-len "
                        "and longer contexts; a batch that does not fit at --kv-len is refused (exit 2)")
    p.add_argument("--perf", action="store_true", help="also print each device graph's roofline floors on "
                   "inf2.8xlarge (prefill at bucket 64, decode), computed without running anything")
    p.add_argument("--plan", action="store_true", help="also print the resource plan of every command: peak "
                   "host memory, device memory per NeuronCore and graphs (harness/plan/host_plan.py)")
    add_host_memory_arg(p, "the budget --plan judges each command's host peak against")
    p.add_argument("--instance", default=None, help="instance type whose published rates --perf uses "
                   "(inf2.xlarge, inf2.8xlarge, inf2.24xlarge, inf2.48xlarge; default: the smallest with --tp "
                   "NeuronCores, inf2.8xlarge up to tp 2)")
    p.add_argument("--instance-rates", metavar="FILE", help="JSON file of per-chip figures for an instance type "
                   "not in the table (cores, chips, hbm_bytes, hbm_bytes_per_s, bf16_flops_per_s, fp32_flops_per_s)")
    p.add_argument("--assistant", metavar="DIR", help="the target's Gemma-4 assistant (drafter) checkpoint "
                   "directory: its bytes per rank and whether the pair fits (docs/speculative.md)")
    p.add_argument("--speculate", type=int, default=None, metavar="K", help="draft length of speculative "
                   "decoding: the device fit counts the verify graph (K+1 positions) at each KV bucket")
    p.set_defaults(func=run, validate=validate)


def _batches_arg(text: str) -> tuple[int, ...]:
    from harness.cli.perf import _batches_arg as parse

    return parse(text)


def validate(args) -> None:
    from harness.inputs.spec import load_spec

    v._int_option(args, "tp", 1)
    v._int_option(args, "kv_len", 1)
    tp_given, args.tp_note = args.tp is not None, None
    if args.config is None and args.checkpoint is None and args.model is None:  # none named: not the 12B
        args.tp_note = "planning the embedded tiny model (none named; the 12B: --config fixtures/configs/gemma-4-12b-it.json)"
    if not tp_given:
        args.tp = args.run_defaults.tp
    v._int_option(args, "seed", 0)
    args.settings = run_settings(args)
    inputs = v.model_inputs(args)
    outputs: dict = {}
    if args.json is not None:
        replaceable_file(output_location(args.json, "--json", False, inputs, outputs), "--json", _json_is_ours)
    clean_leftovers(outputs.values())
    if args.config is not None:
        args.spec, args.ckpt = load_spec(args.config), None
    else:
        args.spec = v.open_checkpoint(args).spec
    if args.speculate is not None:
        from harness.port.speculate import check_speculate

        check_speculate(args.speculate, args.settings)
        args.settings = args.settings.but(speculate=args.speculate)
    args.assistant_spec = None
    if args.assistant is not None:  # its drafter and draft graphs share the target's cores (the fit counts them)
        from harness.inputs.assistant_spec import load_assistant_spec

        from harness.cli.common import assistant_dir

        args.assistant = assistant_dir(args)  # `tiny`: the embedded tiny target's assistant
        args.assistant_spec = load_assistant_spec(v.input_path(args.assistant, "--assistant", True), args.spec)
    if not tp_given:
        _resolve_tp(args)
    v.check_tp(args.spec, args.tp)
    v.check_kv_len(args.spec, args.kv_len)
    v.check_kv_fits(args.spec, args.tp, args.dtype, args.kv_len, args.sliding_cache)
    from harness.plan.instances import check_fits, smallest_instance

    args.placement = check_fits(args.spec, args.tp, args.dtype, args.kv_len, sliding_cache=args.sliding_cache,
                                **_build(args))
    if args.instance is None:  # the instance the TP degree needs (the family's larger variants)
        args.instance = smallest_instance(args.tp).name
    _check_instance(args)
    if args.batch:
        from harness.plan.batch_fit import batch_fit, refuse_unfit_batch

        for batch in args.batch:
            try:
                refuse_unfit_batch(batch_fit(args.spec, args.tp, args.dtype, batch, args.kv_len, chip=args.chip,
                                             sliding_cache=args.sliding_cache, quantize=args.settings.quantize))
            except HarnessInputError as exc:
                raise OptionError(str(exc)) from None


def _build(args) -> dict:
    """The device fit's build keywords (instances.core_bytes): buckets, the weight-layout transform
    (neuron's default), the verify graph of --speculate and the assistant's drafter, for the served
    (perf) build, what the memory plan and --batch count too (the check's parity build, with its
    captures, is printed beside it and per command with --plan)."""
    from harness.plan.instances import layout_transform

    layout = layout_transform(args.settings.backend_options)
    return dict(buckets=args.settings.buckets, layout=layout, speculate=args.settings.speculate,
                assistant=args.assistant_spec, perf=True, quantize=args.settings.quantize)


def parity_core(args) -> dict:
    """The check's parity build at the same options (instances.core_bytes: every row's logits and
    the captures): what a device check needs beside the served build."""
    from harness.plan.instances import core_bytes

    return core_bytes(args.spec, args.tp, args.dtype, args.kv_len, args.sliding_cache, **{**_build(args), "perf": False})


def _resolve_tp(args) -> None:
    """No --tp: the default when the model fits there, else the smallest TP that fits (said first)."""
    from harness.base.errors import ShardingError
    from harness.plan.instances import placement, smallest_fitting_tp

    fit = _build(args)
    try:
        if placement(args.spec, args.tp, args.dtype, args.kv_len, args.sliding_cache, **fit)["fits"]:
            return
    except ShardingError:
        pass  # the default is not a degree the heads allow
    smallest = smallest_fitting_tp(args.spec, args.dtype, args.kv_len, args.sliding_cache, **fit)
    if smallest is None:
        return  # the checks below refuse the default with the numbers
    args.tp_note = (f"{args.tp_note}\n" if args.tp_note else "") + (f"--tp not given: tp={args.tp} (the default) does not fit one NeuronCore per rank; "
                    f"planning at tp={smallest}, the smallest TP that fits")
    args.tp = smallest
    args.settings = run_settings(args)


def _check_instance(args) -> None:
    """The instance's rates, read now: an unknown type or a bad rates file is bad input (exit 2)."""
    from harness.perf.roofline import instance_rates, load_instance_rates

    args.chip = load_instance_rates(args.instance_rates) if args.instance_rates else None
    instance_rates(args.instance, args.settings.tp, args.settings.dtype, args.chip)


def _is_published_model(spec) -> bool:
    """Whether the spec is the model the published latency was measured on (the 12B, whose config
    the repository ships): only then is "floor / published" a comparison of like with like."""
    from harness import FIXTURES_DIR
    from harness.inputs.spec import load_spec

    return spec.spec_hash() == load_spec(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json").spec_hash()


def _summary(args) -> dict:
    """The spec, TP plan and bytes per rank, the weights as they load (int8 under --quantize: core_fit.rank_bytes)."""
    from harness.port.core_fit import rank_bytes
    from harness.port.sharding import plan_summary

    s = args.settings
    memory = rank_bytes(args.spec, s.tp, s.dtype, s.kv_len, quantize=s.quantize)
    return {**plan_summary(args.spec, s.tp, s.dtype, s.kv_len), "memory": memory, "bytes_per_rank": memory["total"]}


def run(args) -> int:
    from harness.perf.roofline import hbm_fit, render_hbm_fit
    from harness.plan.instances import plan_notes
    from harness.plan.memory import instance_memory_plan, render_memory_plan
    from harness.report.formats import format_info

    if args.tp_note:
        print(args.tp_note)
    if args.ckpt is not None:
        print(args.ckpt.describe())  # it says what is inert; the plan below does not repeat it
    s = args.settings
    payload = _summary(args)

    payload["placement"], payload["parity_core"] = args.placement, parity_core(args)
    payload["notes"] = plan_notes(args.spec, args.placement, payload["parity_core"])
    print(format_info({**payload, "inert": None} if args.ckpt is not None else payload))
    payload["memory_plan"] = instance_memory_plan(args.spec, args.tp, args.dtype, args.kv_len, quantize=s.quantize)
    payload["memory_plan"]["sliding_cache"] = args.sliding_cache
    print(render_memory_plan(payload["memory_plan"], args.sliding_cache))
    payload["hbm"] = hbm_fit(args.spec, s.tp, s.dtype, s.kv_len, chip=args.chip, sliding_cache=s.sliding_cache,
                             quantize=s.quantize)
    print(render_hbm_fit(payload["hbm"]))
    if s.quantize:  # the int8 build beside the unquantized one (docs/quantization.md#bytes-and-floors)
        from harness.perf.quantized import quantized_comparison, render_quantized_comparison
        from harness.perf.roofline import instance_rates

        payload["quantization"] = quantized_comparison(args.spec, s.tp, s.dtype, s.kv_len, instance_rates(
            args.instance, s.tp, s.dtype, args.chip), chip=args.chip, sliding_cache=s.sliding_cache)
        print(render_quantized_comparison(payload["quantization"]))
    if args.batch:
        from harness.plan.batch_fit import fit_table

        lengths = sorted({s.kv_len, *(n for n in (4096, 32768, 131072) if n <= (args.spec.max_positions or n))})
        payload["batch_fit"] = fit_table(args.spec, s.tp, s.dtype, args.batch, lengths, chip=args.chip,
                                         sliding_cache=s.sliding_cache, quantize=s.quantize)
        print(render_fit_table(payload["batch_fit"]), end="")
    if args.assistant is not None:
        payload["assistant"] = _assistant_fit(args, payload["memory_plan"])
    if args.perf:
        from harness.perf import info_floors

        payload["roofline"] = info_floors(args.spec, s.tp, s.dtype, s.kv_len, instance=args.instance, chip=args.chip,
                                        sliding_cache=s.sliding_cache, quantize=s.quantize)
        if not _is_published_model(args.spec):
            payload["roofline"].pop("published_ms", None)  # the published latency is the 12B's, not this model's
        print(render_roofline(payload["roofline"]), end="")
        _print_floors_at_length(args, payload)
    if args.plan:
        from harness.plan.host_plan import render_resource_plan, resource_plan

        host = budget(args)[0]  # what this machine has unless --host-memory GIB names another host
        payload["resource_plan"] = resource_plan(args.spec, s.tp, s.dtype, s.kv_len, s.buckets, host_bytes=host,
                                                 sliding_cache=s.sliding_cache, speculate=s.speculate,
                                                 batch=max(args.batch) if args.batch else 1,  # neuron: no batch stage
                                                 assistant=args.assistant_spec, layout=_build(args)["layout"],
                                                 quantize=s.quantize)
        print(render_resource_plan(payload["resource_plan"]))
    if args.json is not None:
        write_json_atomic(args.json, with_generator(payload, "info"))
    return EXIT_OK


def _print_floors_at_length(args, payload) -> None:
    """TTFT and TPOT floors at 1K..128K with the chosen sliding cache, in a build whose KV length is
    the longest context that fits (harness/perf/context.py)."""
    from harness.perf.context import floors_at_length, render_floors_at_length
    from harness.perf.roofline import instance_rates

    plan = payload["memory_plan"]
    longest = plan["caches"][args.sliding_cache]["longest_context"]
    rates = instance_rates(plan["instance"], args.tp, args.dtype, getattr(args, "chip", None))  # --instance-rates too
    rows = floors_at_length(args.spec, args.tp, args.dtype, buckets=(64, 256), longest=longest, rates=rates,
                            sliding_cache=args.sliding_cache)
    payload["floors_at_length"] = rows
    print(f"floors at length ({args.sliding_cache} sliding cache, buckets 64,256, KV length {longest}):")
    print(render_floors_at_length(rows), end="")


def _assistant_fit(args, plan: dict) -> dict:
    """The assistant's bytes per rank beside the target's, on the instance's device."""
    from harness.inputs.spec import dtype_bytes

    aspec, cache = args.assistant_spec, plan["caches"][args.sliding_cache]
    per_rank = aspec.bytes_per_rank(args.tp, dtype_bytes(args.dtype))
    total = cache["total_bytes"] + per_rank * plan["ranks_per_device"]
    fit = {"model_type": aspec.model_type, "layers": len(aspec.layers), "hidden_size": aspec.hidden_size,
           "reads_target_layers": sorted({layer.kv_source for layer in aspec.layers}),
           "masked_head": aspec.ordered, "bytes_per_rank": per_rank, "device": plan["device"],
           "pair_bytes_per_device": total, "device_bytes": plan["device_bytes"], "fits": total <= plan["device_bytes"]}
    print(f"assistant ({aspec.model_type}, {len(aspec.layers)} layers, hidden {aspec.hidden_size}, reads target "
          f"layers {fit['reads_target_layers']}, no cache of its own): {per_rank / 2**20:.1f} MiB per rank; "
          f"target + assistant {total / 2**30:.2f} GiB of {plan['device_bytes'] / 2**30:.0f} GiB per {plan['device']}: "
          f"{'fits' if fit['fits'] else 'DOES NOT FIT'}")
    return fit
