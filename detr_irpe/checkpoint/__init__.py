"""Checkpoint files: one safe reader, one atomic writer, key layouts, loading into a model.

- :func:`read_checkpoint` ``(path) -> (state_dict, meta)``: every layout this project
  accepts (own ``.pth`` / ``.safetensors``, public DETR and iRPE-DETR, the reference
  training script's files, Hugging Face DETR), each file read once;
- :func:`safe_load`: ``torch.load(weights_only=True)`` allowing only ``argparse.Namespace``;
- :func:`atomic_save` / :func:`save_safetensors`: temp file + fsync + ``os.replace``;
- :func:`load_checkpoint` / :func:`load_state`: into a model, with the class-head and
  iRPE-table rules and errors that name the differing config keys;
- :func:`convert_state_dict`: offline class-head resize and iRPE-table insertion.

This package imports nothing from :mod:`detr_irpe.models` at import time, so the models
can use it.
"""

from detr_irpe.checkpoint.files import (
    FORMAT,
    allowed_classes,
    atomic_save,
    atomic_write,
    format_keys,
    read_checkpoint,
    safe_load,
    save_safetensors,
    split_checkpoint,
    write_temp,
)
from detr_irpe.checkpoint.layout import (
    HEAD_KEYS,
    add_rpe_tables,
    architecture,
    convert_state_dict,
    explain_mismatch,
    is_rpe_key,
    resize_class_head,
)
from detr_irpe.checkpoint.load import key_problems, load_checkpoint, load_state
from detr_irpe.errors import CheckpointError

__all__ = [
    "key_problems",
    "FORMAT",
    "HEAD_KEYS",
    "CheckpointError",
    "add_rpe_tables",
    "allowed_classes",
    "architecture",
    "atomic_save",
    "atomic_write",
    "convert_state_dict",
    "explain_mismatch",
    "format_keys",
    "is_rpe_key",
    "load_checkpoint",
    "load_state",
    "read_checkpoint",
    "resize_class_head",
    "safe_load",
    "save_safetensors",
    "split_checkpoint",
    "write_temp",
]
