"""Training engine: a run, its loop and hooks, resume, evaluation, distributed set-up, logs.

- :func:`run_training` (``runner``): a whole training run, as the tool calls it; its
  steps are ``start`` (resume / fine-tune / scratch, the process's settings, the
  resumed-config check), ``classes`` (the class count from the data), ``parts`` (data,
  model, optimizer, EMA, DDP), ``resume`` (a checkpoint's state restored into them) and
  ``run_hooks`` (evaluation, ``log.txt``, checkpoints and the signal stop).
- :func:`train_step` / :func:`train_one_epoch` / :func:`train` (``trainer``): the loop;
  :class:`TrainHook` and :class:`LoopState`: what the training loop calls at fixed
  points, and what it hands them (``hooks``: the generic hooks).
- :func:`evaluate` (``evaluation``): a model on a loader, the one evaluation pass of the
  training run and of a checkpoint's evaluation (``checkpoint_eval.run_evaluation``,
  the program of ``detr-irpe-eval``).
- ``optim``: AdamW groups and the lr schedule (StepLR in epochs, warm-up in iterations).
- ``precision``: ``train.amp`` (autocast, GradScaler; ``auto``: bf16 on a CPU with native bf16).
- ``rng``: seeding, and the RNG states a checkpoint keeps.
- ``interrupt``: SIGTERM / SIGINT become a stop at the next step boundary.
- ``distributed``: process groups for one process, ``torchrun`` and SLURM.

What a run folder holds, its lock and its checkpoints are :mod:`detr_irpe.run_folder`.
"""

from detr_irpe.engine.distributed import DistInfo, init_distributed
from detr_irpe.engine.evaluation import evaluate
from detr_irpe.engine.rng import seed_everything
from detr_irpe.engine.runner import run_training
from detr_irpe.engine.trainer import (
    LoopState,
    NonFiniteLossError,
    TrainHook,
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
