"""Checkpoint files and the weights in them: safe readers, one reader for every layout,
atomic writers, key layouts, loading into a model, and the config a checkpoint implies.

- ``safe``: :func:`safe_load` (``torch.load(weights_only=True)`` allowing only
  ``argparse.Namespace``) and :func:`load_safetensors`; a leaf module;
- ``files``: :func:`read_checkpoint` ``(path) -> (state_dict, meta)``: every layout this
  project accepts (own ``.pth`` / ``.safetensors``, public DETR, iRPE-DETR, DAB-DETR and
  DN-DETR, the reference training scripts' files, Hugging Face DETR and DAB-DETR), each
  file read once;
  :func:`atomic_save` / :func:`save_safetensors`;
- ``layout``: key layouts, :func:`architecture` (what a state dict says about its model),
  :func:`family_name_of_state` / :func:`num_classes_of` (as the family reads its head),
  :func:`explain_mismatch`, :func:`convert_state_dict` (class-head resize, iRPE tables);
- ``hf_keys`` / ``hf_folder``: Hugging Face key renaming (``KeyTable``; DETR's names) and
  ``save_pretrained`` folders of every family with an ``HFSupport``;
- ``load``: :func:`load_weights` / :func:`load_state` into a model, with the class-head
  and iRPE-table rules, :func:`check_state_fits` (a resume's strict check), and errors
  that name the differing config keys;
- ``saved_config``: :func:`config_for_checkpoint`, the config a checkpoint's model is
  built from (``detr_irpe.models.model_from_checkpoint`` builds it): the saved one, a
  Hugging Face ``config.json``, or the one a file's family says its layout implies;
- ``zoo``: the published checkpoints' addresses.

Which checkpoints a training run keeps (last / prev / best, resume discovery) is
:mod:`detr_irpe.run_folder.checkpoints`. This package imports nothing from
:mod:`detr_irpe.models`, so the models can use it: what differs between families comes
from their registry entries (:mod:`detr_irpe.family`).
"""

from detr_irpe.checkpoint.files import (
    atomic_save,
    read_checkpoint,
    save_safetensors,
    split_checkpoint,
)
from detr_irpe.checkpoint.layout import (
    HEAD_KEYS,
    add_rpe_tables,
    architecture,
    convert_state_dict,
    explain_mismatch,
    family_name_of_state,
    layout_of,
    num_classes_of,
    resize_class_head,
)
from detr_irpe.checkpoint.load import (
    check_published,
    check_state_fits,
    key_problems,
    load_state,
    load_weights,
)
from detr_irpe.checkpoint.safe import FORMAT, allowed_classes, format_keys, safe_load
from detr_irpe.checkpoint.saved_config import config_for_checkpoint, has_config, resolve_config
from detr_irpe.errors import CheckpointError

__all__ = [
    "FORMAT",
    "HEAD_KEYS",
    "CheckpointError",
    "add_rpe_tables",
    "allowed_classes",
    "architecture",
    "atomic_save",
    "check_state_fits",
    "config_for_checkpoint",
    "convert_state_dict",
    "explain_mismatch",
    "family_name_of_state",
    "format_keys",
    "has_config",
    "key_problems",
    "layout_of",
    "check_published",
    "load_state",
    "load_weights",
    "num_classes_of",
    "read_checkpoint",
    "resize_class_head",
    "resolve_config",
    "safe_load",
    "save_safetensors",
    "split_checkpoint",
]
