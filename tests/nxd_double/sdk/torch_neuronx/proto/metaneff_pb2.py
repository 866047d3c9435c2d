"""The metaneff message as NxD reads it (torch_neuronx.proto.metaneff_pb2).

Field and enum names as used by neuronx-distributed Release 2.29
(src/neuronx_distributed/trace/nxd_model/nxd_model.py NxDModel.add, and trace/functions.py
_update_metaneff_with_user_input_key): MetaNeff.input_tensors / output_tensors /
output_aliases_to; MetaTensor.type (Type.USER_INPUT, INPUT_WEIGHT, INPUT_STATE), .checkpoint_key
(bytes), .user_input_key (bytes), .shape, .data_type. Plain Python, not protobuf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class MetaTensor:
    class Type(enum.IntEnum):
        USER_INPUT = 0
        INPUT_WEIGHT = 1
        INPUT_STATE = 2
        OUTPUT = 3

    def __init__(self, type, shape, data_type: str, checkpoint_key: bytes = b"", user_input_key: bytes = b""):
        self.type = type
        self.shape = list(shape)
        self.data_type = data_type
        self.checkpoint_key = checkpoint_key
        self.user_input_key = user_input_key

    def __repr__(self):
        return f"MetaTensor({self.type.name}, {self.checkpoint_key or self.user_input_key!r}, {self.shape})"


@dataclass
class MetaNeff:
    input_tensors: list = field(default_factory=list)
    output_tensors: list = field(default_factory=list)
    output_aliases_to: dict = field(default_factory=dict)  # output index -> aliased input index

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return repr(self).encode()
