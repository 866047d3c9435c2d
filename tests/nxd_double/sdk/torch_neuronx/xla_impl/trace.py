"""torch_neuronx.xla_impl.trace.get_torch_dtype, as NxDModel uses it to read metaneff dtypes."""

import torch


def get_torch_dtype(data_type) -> torch.dtype:
    dtype = getattr(torch, str(data_type), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown metaneff data type {data_type!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
