"""Old import path of the checkpoint functions, kept only until every caller imports
:mod:`detr_irpe.checkpoint`; new code imports from there."""

from detr_irpe.checkpoint import (
    FORMAT as OWN_FORMAT,
)
from detr_irpe.checkpoint import (
    HEAD_KEYS,
    CheckpointError,
    convert_state_dict,
    is_rpe_key,
    load_checkpoint,
    read_checkpoint,
)
from detr_irpe.checkpoint import (
    safe_load as safe_torch_load,
)

__all__ = [
    "HEAD_KEYS",
    "OWN_FORMAT",
    "CheckpointError",
    "convert_state_dict",
    "is_rpe_key",
    "load_checkpoint",
    "read_checkpoint",
    "safe_torch_load",
]
