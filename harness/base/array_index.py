"""`--shard auto`: which shard this machine writes, from the array-job index the scheduler sets.

No job runner of our own: each scheduler already starts N copies of one command and tells each
its index. Read here (docs/ci.md#sharding-over-machines has a worked example for each):

  AWS Batch array job       AWS_BATCH_JOB_ARRAY_INDEX (0..N-1); N is not in the environment:
                            give it as `--shard auto/N` (the array's size)
  Kubernetes indexed Job    JOB_COMPLETION_INDEX (0..N-1); N likewise: `--shard auto/N` (completions)
  Slurm job array           SLURM_ARRAY_TASK_ID, offset by SLURM_ARRAY_TASK_MIN, of
                            SLURM_ARRAY_TASK_COUNT tasks (`--array=0-3` or `--array=1-4` alike)

The count may also come from an existing golden (its quality-golden.json fixes the shard count).
Two schedulers' variables that disagree, an index that is not a plain number, or one outside
0..N-1 are refused (exit 2) with the variable's name and value.
"""

from __future__ import annotations

import re

from harness.base.errors import OptionError

SCHEDULERS = (("AWS Batch", "AWS_BATCH_JOB_ARRAY_INDEX"), ("Kubernetes", "JOB_COMPLETION_INDEX"),
              ("Slurm", "SLURM_ARRAY_TASK_ID"))
MAX_SHARDS = 100_000


def _number(environ, name: str) -> int | None:
    value = environ.get(name)
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]{1,9}", value.strip()):
        raise OptionError(f"--shard auto: {name}={value!r} is not a plain array index (ASCII digits); "
                          "run under the scheduler's array job, or give --shard I/N")
    return int(value)


def _slurm(environ) -> tuple[int, int | None] | None:
    task = _number(environ, "SLURM_ARRAY_TASK_ID")
    if task is None:
        return None
    low, count = _number(environ, "SLURM_ARRAY_TASK_MIN") or 0, _number(environ, "SLURM_ARRAY_TASK_COUNT")
    step = _number(environ, "SLURM_ARRAY_TASK_STEP") or 1
    if (task - low) % step:
        raise OptionError(f"--shard auto: SLURM_ARRAY_TASK_ID={task} is not on the array's step {step} from "
                          f"SLURM_ARRAY_TASK_MIN={low}; use a dense array (--array=0-{(count or 1) - 1})")
    return (task - low) // step, count


def shard_from_environment(text: str, environ, existing_count: int | None = None) -> tuple[int, int]:
    """(index, count) for `--shard auto` or `--shard auto/N` under the scheduler's variables."""
    _, _, given = text.partition("/")
    count = None
    if given:
        if not re.fullmatch(r"[0-9]{1,6}", given):
            raise OptionError(f"--shard {text}: N must be a whole number, e.g. --shard auto/4")
        count = int(given)
    found = {name: (_number(environ, var), None) for name, var in SCHEDULERS[:2]}
    found["Slurm"] = _slurm(environ)
    found = {name: pair for name, pair in found.items() if pair is not None and pair[0] is not None}
    if not found:
        raise OptionError(f"--shard {text}: no array-job index in the environment (looked for "
                          f"{', '.join(var for _, var in SCHEDULERS)}); run it as an array job, or give --shard I/N")
    if len({pair[0] for pair in found.values()}) > 1:
        raise OptionError(f"--shard {text}: the schedulers' indices disagree ({found}); unset the stale one")
    index, env_count = next(iter(found.values()))
    for source, n in (("--shard auto/N", count), ("SLURM_ARRAY_TASK_COUNT", env_count),
                      ("the golden's quality-golden.json", existing_count)):
        if n is not None and count is not None and n != count:
            raise OptionError(f"--shard {text}: {source} says {n} shards, not {count}; give the array's size")
        count = count if count is not None else n
    if count is None:
        raise OptionError(f"--shard {text}: {', '.join(found)} gives the index ({index}) but not the number of "
                          "shards; give it: --shard auto/N (N = the array's size)")
    if not 1 <= count <= MAX_SHARDS or not 0 <= index < count:
        raise OptionError(f"--shard {text}: index {index} of {count} shards ({', '.join(found)}); need "
                          f"0 <= index < N <= {MAX_SHARDS} (is the array 0-based and of size N?)")
    return index, count
