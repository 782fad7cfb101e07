"""The run folder (``train.output_dir``): what it holds, who may write it, which
experiment it is, which checkpoints it keeps and where its run stands. The training
engine writes run folders through this package; the grid scheduler, the ablation
tables and the training curves read them through it.

A run folder holds::

    config.yaml             the resolved config (num_classes, amp filled in)
    train.log               python logging of rank 0
    log.txt                 DETR's JSON lines, one object per epoch (log.py)
    checkpoint_last.pth     newest complete checkpoint, + checkpoint_prev.pth and
                            checkpoint_best.pth (checkpoints.py)
    eval/                   results.json, metrics.json, precision.npz of the last evaluation
    tensorboard/            scalars, when tensorboard is installed
    .run.lock               the training process's lock (lock.py)
    .ablation.lock          the lock of a grid scheduler that launched the run
    ablation_status.json    how a grid's last launch of the run ended (status.py)
    ablation_output.log     the run's console output under a grid

- ``lock``: :class:`RunLock` (one writer per folder; the ranks' agreement on it is
  :func:`detr_irpe.engine.distributed.lock_run_folder`),
  :func:`lock_holder`;
- ``experiment``: :func:`experiment_differences`, the one rule for "same experiment"
  (:data:`NOT_IDENTITY` the one list of keys that never count);
- ``checkpoints``: rotation of last / prev, the best one, resume discovery;
- ``log``: reading and writing ``log.txt``;
- ``status``: :class:`RunState` and :func:`run_state`.
"""

from detr_irpe.run_folder.checkpoints import (
    BEST,
    LAST,
    PREV,
    find_resume_checkpoint,
    link_best,
    read_training_checkpoint,
    repair_best,
    save_training_checkpoint,
)
from detr_irpe.run_folder.experiment import (
    NOT_IDENTITY,
    config_differences,
    experiment_differences,
)
from detr_irpe.run_folder.lock import CLAIM_NAME, LOCK_NAME, RunLock, lock_holder
from detr_irpe.run_folder.log import JsonLinesLog, read_log
from detr_irpe.run_folder.status import RunState, config_mismatch, is_finished, run_state

__all__ = [
    "BEST",
    "CLAIM_NAME",
    "LAST",
    "LOCK_NAME",
    "NOT_IDENTITY",
    "PREV",
    "JsonLinesLog",
    "RunLock",
    "RunState",
    "config_differences",
    "config_mismatch",
    "experiment_differences",
    "find_resume_checkpoint",
    "is_finished",
    "link_best",
    "lock_holder",
    "read_log",
    "read_training_checkpoint",
    "repair_best",
    "run_state",
    "save_training_checkpoint",
]
