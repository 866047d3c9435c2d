"""How the port runs: one `RunSettings` (backend, TP degree, dtype, prefill buckets, KV length,
backend options) with every default written once, and the one parser of dtype names.

The commands fill it from their arguments (`harness/cli/common.py`), the library functions take it
whole, and `harness.backends.build_engine` builds from it. To add a setting: add a field with its
default here, fill it in `cli.common.run_settings`, and read it where the port needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from harness.base.errors import OptionError

DEFAULT_BACKEND = "cpu"
DEFAULT_TP = 2  # one inf2 chip: two NeuronCores
DEFAULT_DTYPE = "bfloat16"
DEFAULT_KV_LEN = 256  # the published port's KV length
PUBLISHED_BUCKET = 64  # the published port's prefill bucket (what `bench` times by default)
# `check` and `bisect` run the default prompts, the longest of which reaches position 247.
DEFAULT_BUCKETS = (PUBLISHED_BUCKET, 256)
# How sliding layers keep their keys: "linear" (kv_len slots) or "ring" (window slots); docs/long-context.md
# says why linear is the default.
SLIDING_CACHES = ("linear", "ring")
DEFAULT_SLIDING_CACHE = "linear"
# Weight storage of the port (--quantize; None: the checkpoint's weights in the run dtype). The
# scheme itself is harness/inputs/quantize.py's (docs/quantization.md).
QUANTIZE_CHOICES = ("int8",)

# The dtype vocabulary of every command and library function: the canonical name (what results
# and goldens record) and the short name (what bench results record), each accepted on input.
DTYPES = {"bfloat16": ("bf16", torch.bfloat16), "float32": ("fp32", torch.float32)}
_ALIASES = {**{name: name for name in DTYPES}, **{short: name for name, (short, _) in DTYPES.items()}}


def dtype_name(value) -> str:
    """The canonical name ("bfloat16" or "float32") of a dtype given as a name, a short name
    ("bf16", "fp32") or a torch.dtype; anything else is bad input naming the value."""
    text = str(value).replace("torch.", "") if isinstance(value, (str, torch.dtype)) else None
    if text not in _ALIASES:
        raise OptionError(f"--dtype {value!r}: unknown dtype; use one of {', '.join(sorted(_ALIASES))}")
    return _ALIASES[text]


def short_dtype_name(value) -> str:
    """"bf16" or "fp32": the name bench results record."""
    return DTYPES[dtype_name(value)][0]


def torch_dtype(value) -> torch.dtype:
    return DTYPES[dtype_name(value)][1]


def parse_buckets(text: str) -> tuple[int, ...]:
    """"16,64" -> (16, 64): sorted, without repeats; an empty or non-integer list is bad input."""
    try:
        buckets = tuple(sorted({int(b) for b in text.split(",") if b.strip()}))
    except ValueError:
        raise OptionError(f"--buckets {text!r}: expected comma-separated integers like 16,64") from None
    if not buckets or min(buckets) < 1:
        raise OptionError(f"--buckets {text!r}: need at least one positive bucket")
    return buckets


def parse_backend_options(pairs) -> dict[str, str]:
    """["key=value", ...] (repeated --backend-option) -> {key: value}; the backend converts the values."""
    options: dict[str, str] = {}
    for pair in pairs or ():
        key, eq, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise OptionError(f"--backend-option {pair!r}: expected KEY=VALUE, e.g. compile_workers=4")
        if key in options:
            raise OptionError(f"--backend-option {key}: given twice")
        options[key] = value
    return options


# Converters of backend option values (text from the command line, or values from code); a backend
# names one per option in its OPTIONS. A ValueError is reported naming the option.

def flag(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def positive_int(value) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be at least 1")
    return number


def directory(value) -> Path:
    if not str(value).strip():
        raise ValueError("empty path")
    return Path(value)


@dataclass(frozen=True)
class RunSettings:
    """How the port runs. `dtype` is always canonical ("bfloat16"/"float32") whatever name it was
    given as; `buckets` sorted without repeats; `backend_options` are checked against the backend's
    declared options when it is built (`harness.backends.backend_options`)."""

    backend: str = DEFAULT_BACKEND
    tp: int = DEFAULT_TP
    dtype: str = DEFAULT_DTYPE
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    kv_len: int = DEFAULT_KV_LEN
    backend_options: Mapping[str, object] = field(default_factory=dict)
    sliding_cache: str = DEFAULT_SLIDING_CACHE
    batch: int = 1  # KV slots: the most sequences served at once (NxD Inference's max_batch_size)
    # Speculative decoding's draft length k (--speculate K; 0: none): a compiled build then holds a
    # verify graph of k+1 positions (harness/port/graphs.py graph_plan, docs/speculative.md)
    speculate: int = 0
    # The assistant checkpoint directory of a speculative run (--assistant DIR): a compiled backend that
    # drafts on the device builds its drafter into the target's graphs (docs/speculative.md)
    assistant: str | None = None
    # --quantize: int8 weight storage (harness/inputs/quantize.py); None: unquantized
    quantize: str | None = None
    # --demo-fault NAME: a known port bug planted for a demonstration (harness/port/demo_fault.py); None
    # for every real run. A setting so that it travels into the snapshot and the repro.
    demo_fault: str | None = None

    def __post_init__(self):
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise OptionError(f"--quantize {self.quantize!r}: use one of {', '.join(QUANTIZE_CHOICES)} "
                              "(or leave it out for the unquantized port)")
        if self.sliding_cache not in SLIDING_CACHES:
            raise OptionError(f"--sliding-cache {self.sliding_cache!r}: use one of {', '.join(SLIDING_CACHES)}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "buckets", tuple(sorted({int(b) for b in self.buckets})))
        object.__setattr__(self, "backend_options", MappingProxyType(dict(self.backend_options)))
        if not self.buckets or min(self.buckets) < 1:
            raise OptionError(f"--buckets {self.buckets}: need at least one positive bucket")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise OptionError(f"--batch {self.batch!r}: need a positive number of sequences")
        if isinstance(self.speculate, bool) or not isinstance(self.speculate, int) or self.speculate < 0:
            raise OptionError(f"--speculate {self.speculate!r}: the draft length must be a non-negative integer "
                              "(0: no speculative decoding)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def short_dtype(self) -> str:
        return short_dtype_name(self.dtype)

    def but(self, **changes) -> "RunSettings":
        """A copy with some settings changed (e.g. `settings.but(dtype="float32")`)."""
        return replace(self, **changes)

    def describe(self) -> str:
        return (f"{self.backend}, tp {self.tp}, {self.dtype}, buckets {list(self.buckets)}, "
                f"KV length {self.kv_len}" + (f", {self.sliding_cache} sliding cache" if self.sliding_cache != "linear" else "")
                + (f", {self.quantize} weights" if self.quantize else ""))
