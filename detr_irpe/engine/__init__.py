"""Training and evaluation engine: loops, atomic checkpoints, resume, distributed set-up, logs.

- :func:`run_training` / :func:`run_evaluation` (``runner``): a whole run, as the tools call it.
- :func:`train_step` / :func:`train_one_epoch` / :func:`evaluate` (``trainer``): the loops.
- ``optim``: AdamW groups and the lr schedule (StepLR in epochs, warm-up in iterations).
- ``checkpoint_io``: atomic save, rotation, validation, resume discovery, RNG states.
- ``run_lock``: one run per run folder (an OS lock naming its holder), writability checks.
- ``interrupt``: SIGTERM / SIGINT become a stop at the next step boundary.
- ``distributed``: process groups for one process, ``torchrun`` and SLURM.
"""

from detr_irpe.engine.checkpoint_io import (
    CheckpointError,
    find_resume_checkpoint,
    load_checkpoint_file,
    save_training_checkpoint,
)
from detr_irpe.engine.distributed import DistInfo, init_distributed, seed_everything
from detr_irpe.engine.runner import format_summary, run_evaluation, run_training
from detr_irpe.engine.trainer import NonFiniteLossError, evaluate, train_one_epoch, train_step

__all__ = [
    "CheckpointError",
    "DistInfo",
    "NonFiniteLossError",
    "evaluate",
    "find_resume_checkpoint",
    "format_summary",
    "init_distributed",
    "load_checkpoint_file",
    "run_evaluation",
    "run_training",
    "save_training_checkpoint",
    "seed_everything",
    "train_one_epoch",
    "train_step",
]
