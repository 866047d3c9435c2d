"""Performance: timed prefill and decode runs with roofline floors, budgets, a run history with
change points, and regression detection (their text, Markdown and PNGs are harness/report's
perf_text and perf_plot). One job per module:

  machine       the machine and software of a run; this host's measured bandwidth and matmul rate
  stats         percentiles, Mann-Whitney U (scipy), runs needed for a level, bootstrap intervals
  outputs       the tokens and argmax margins a bench generated, and whether two runs' agree
  results       result files, their validation, the history directory
  roofline      per-graph floors from the spec, the TP plan and the hardware's figures
  bench         the benchmark runner: TTFT, TPOT, E2E, throughput, efficiency per graph
  compare       budgets, the decision rule, comparisons of two runs
  changepoints  change points over run medians (CUSUM permutation test, binary segmentation)
  history       `perf compare --history` (a baseline from the history, trend, change points) and of two files
  environment   what else the machine ran during a bench, and the rule that says two runs are not comparable

The names below are the package's API (what `gemma-parity bench`/`perf compare` and the tests use).
"""

from harness.perf.bench import (DEFAULT_NEW_TOKENS, DEFAULT_RUNS, DEFAULT_WARMUP, PUBLISHED_BUCKET, bench_prompt,
                                graph_medians, run_bench)
from harness.perf.changepoints import ChangePoint, cusum, find_change_points, find_family
from harness.perf.compare import (BUDGETS, DEFAULT_ALPHA, DEFAULT_FACTOR, MAX_ALPHA, BudgetCheck, Comparison, MetricComparison,
                                  check_budgets, check_comparable, compare_metric, compare_results,
                                  compare_samples, decide, parse_budgets, pin_outputs, software_notes)
from harness.perf.history import HISTORY_WINDOW, compare_files, compare_history, median_run_samples
from harness.perf.machine import git_commit, machine_info, package_versions
from harness.perf.results import (BASELINE_FILE, COMPARABLE_FIELDS, FORMAT, append_history, dtype_name,
                                  load_history, load_result, mismatches, validate_result, write_json, write_text)
from harness.perf.roofline import DEFAULT_INSTANCE, info_floors, instance_rates, measured_rates, roofline_block
from harness.perf.samples import budget_samples, latency_samples, metric_samples
from harness.perf.stats import (mann_whitney_greater, mann_whitney_less, percentile, ratio_interval, runs_needed,
                                smallest_p, summarize)

