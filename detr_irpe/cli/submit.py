"""Submit a training run to SLURM through submitit: one task per GPU on one or many
nodes, requeued where it stopped after a time-out or a preemption.

Every option this program does not know goes to detr-irpe-train (tools/train.py),
which runs on each task with the same arguments. 2 nodes x 8 GPUs, 72 hours per job::

    detr-irpe-submit --nodes 2 --gpus-per-node 8 --partition gpu --timeout 4320 \\
        --config detr_r50_irpe --output-dir outputs/detr_r50_irpe_16gpu \\
        --set data.root=/data/coco

One node with 8 GPUs (the iRPE recipe: 2 images per GPU)::

    detr-irpe-submit --gpus-per-node 8 --partition gpu \\
        --config detr_r50_irpe --set data.root=/data/coco

The job sets torch.distributed up from the SLURM environment (rank, world size, the
first node as the master). submitit asks SLURM for USR2 --signal-delay seconds before
the time limit (and at a preemption, where the cluster sends it): the run stops at the
next step boundary with a checkpoint at that step, and the job is requeued with the
same command, which resumes from OUTPUT_DIR/checkpoint_last.pth. The configuration and
the arguments are checked here, before anything is submitted; submitit's files and the
tasks' logs go to --job-dir (default OUTPUT_DIR/submitit).

--cluster local runs the same job on this machine (submitit's local executor: a
process per task, the same signals and requeue), e.g. to try a command::

    detr-irpe-submit --cluster local --gpus-per-node 0 --wait \\
        --config synthetic_tiny --device cpu --set data.root=datasets/synthetic

Exit status: 0 submitted (with --wait: the job succeeded); 2 a bad option, config or
checkpoint name (one line on stderr); 1 with --wait when the job failed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from detr_irpe.cli import train
from detr_irpe.cli.args import new_parser, run_main

CLUSTERS = ("slurm", "local")
# DETR's own launcher asks for 72 hours; lower it to what the partition allows.
DEFAULT_TIMEOUT_MIN = 72 * 60
# Seconds between SLURM's USR2 and the time limit: a step, a COCO evaluation at the end of
# an epoch when the signal falls in it, and the checkpoint write have to fit.
DEFAULT_SIGNAL_DELAY_S = 300
DEFAULT_MAX_REQUEUES = 3


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. account=myproject), "
                                         f"got {text!r}")
    return key.strip().replace("-", "_"), value.strip()


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def _positive(text: str) -> int:
    return _whole_number(text, 1)


def _non_negative(text: str) -> int:
    return _whole_number(text, 0)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-submit")
    # abbreviations off: a prefix of a training option must not be taken for one of these
    parser.allow_abbrev = False
    parser.add_argument("--cluster", choices=CLUSTERS, default="slurm",
                        help="slurm (sbatch, default) or local (this machine)")
    parser.add_argument("--nodes", type=_positive, default=1, help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=_non_negative, default=8,
                        help="GPUs per node, one task each (default 8; 0: CPU tasks)")
    parser.add_argument("--tasks-per-node", type=_positive, default=None,
                        help="processes per node (default: --gpus-per-node, or 1 without GPUs)")
    parser.add_argument("--cpus-per-task", type=_positive, default=None,
                        help="CPU cores per task (default: data.num_workers + 1)")
    parser.add_argument("--mem-gb", type=_positive, default=None,
                        help="memory per node in GB (default: the partition's)")
    parser.add_argument("--partition", default=None, help="SLURM partition")
    parser.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT_MIN,
                        metavar="MINUTES",
                        help="time limit of each job in minutes (default %(default)s: 72 h)")
    parser.add_argument("--signal-delay", type=_positive, default=DEFAULT_SIGNAL_DELAY_S,
                        metavar="SECONDS",
                        help="USR2 this long before the time limit (default %(default)s)")
    parser.add_argument("--max-requeues", type=_non_negative, default=DEFAULT_MAX_REQUEUES,
                        help="requeues after a time-out (default %(default)s; preemptions "
                             "do not count)")
    parser.add_argument("--job-dir", type=Path, default=None,
                        help="submitit's files and the tasks' logs (default OUTPUT_DIR/submitit)")
    parser.add_argument("--job-name", default=None,
                        help="SLURM job name (default: the run folder's name)")
    parser.add_argument("--slurm-option", dest="slurm_options", type=_key_value,
                        action="append", default=[], metavar="KEY=VALUE",
                        help="any other sbatch option, e.g. account=myproject or "
                             "constraint=volta32gb (repeatable)")
    parser.add_argument("--wait", action="store_true",
                        help="wait for the job to end and exit with its outcome")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, train_argv = build_parser().parse_known_args(argv)
    # the training's arguments as detr-irpe-train parses them (its usage and exit status 2
    # for an unknown option)
    train_args = train.build_parser().parse_args(train_argv)

    def body() -> int:
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import submit as program

        return program.run(args, train_argv, train_args)

    return run_main(body, tool="detr-irpe-submit")


__all__ = ["build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.submit
    raise SystemExit(main())
