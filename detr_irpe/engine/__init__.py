"""Training engine: loops, resume, distributed set-up, logs.

- :func:`run_training` (``runner``): a whole training run, as the tool calls it (the
  evaluation program of a checkpoint is ``detr_irpe.cli.eval.run_evaluation``).
- :func:`train_step` / :func:`train_one_epoch` / :func:`train` / :func:`evaluate`
  (``trainer``): the loops; :class:`TrainHook` and :class:`LoopState`: what the training
  loop calls at fixed points, and what it hands them (``hooks``: the generic hooks).
- ``optim``: AdamW groups and the lr schedule (StepLR in epochs, warm-up in iterations).
- ``precision``: ``train.amp`` (autocast, GradScaler; ``auto``: bf16 on a CPU with native bf16).
- ``rng``: seeding, and the RNG states a checkpoint keeps.
- ``interrupt``: SIGTERM / SIGINT become a stop at the next step boundary.
- ``distributed``: process groups for one process, ``torchrun`` and SLURM.

What a run folder holds, its lock and its checkpoints are :mod:`detr_irpe.run_folder`.
"""

from detr_irpe.engine.distributed import DistInfo, init_distributed
from detr_irpe.engine.rng import seed_everything
from detr_irpe.engine.runner import run_training
from detr_irpe.engine.trainer import (
    LoopState,
    NonFiniteLossError,
    TrainHook,
    evaluate,
    train,
    train_one_epoch,
    train_step,
)

__all__ = [
    "DistInfo",
    "LoopState",
    "NonFiniteLossError",
    "TrainHook",
    "evaluate",
    "init_distributed",
    "run_training",
    "seed_everything",
    "train",
    "train_one_epoch",
    "train_step",
]
