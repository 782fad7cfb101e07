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
import shutil
import sys
from pathlib import Path
from typing import Any

from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli import train
from detr_irpe.cli.common import new_parser, run_main
from detr_irpe.cli.programs.train import run_config
from detr_irpe.cli.submit_job import TrainJob
from detr_irpe.errors import ConfigError
from detr_irpe.utils.files import ensure_writable_folder

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


def _import_submitit() -> Any:
    try:
        import submitit  # optional dependency (the slurm extra)
    except ImportError:
        raise ConfigError("detr-irpe-submit needs submitit: pip install 'detr_irpe[slurm]' "
                          "(or pip install submitit)") from None
    return submitit


def _check_training(train_argv: list[str]) -> Any:
    """The training's arguments and config, checked as detr-irpe-train would; published
    checkpoint names are downloaded here, where the network may be (compute nodes often
    have none), into the cache the tasks read."""
    args = train.build_parser().parse_args(train_argv)
    cfg = run_config(args)
    for spec in (args.finetune, args.resume):
        if spec is not None:
            resolve_checkpoint(spec, progress=not args.no_progress)
    return cfg


def executor_parameters(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """submitit ``AutoExecutor.update_parameters`` keywords of the options."""
    tasks = args.tasks_per_node or max(args.gpus_per_node, 1)
    params: dict[str, Any] = {
        "name": args.job_name or Path(cfg.train.output_dir).name or "detr_irpe",
        "nodes": args.nodes,
        "tasks_per_node": tasks,
        "gpus_per_node": args.gpus_per_node,
        "cpus_per_task": args.cpus_per_task or cfg.data.num_workers + 1,
        "timeout_min": args.timeout,
        "slurm_signal_delay_s": args.signal_delay,
    }
    if args.mem_gb is not None:
        params["mem_gb"] = args.mem_gb
    if args.partition is not None:
        params["slurm_partition"] = args.partition
    if args.slurm_options:
        params["slurm_additional_parameters"] = dict(args.slurm_options)
    return params


def _check_cluster(args: argparse.Namespace) -> None:
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if args.cluster == "slurm" and missing:
        raise ConfigError(f"{' and '.join(missing)} not on PATH: run detr-irpe-submit on a "
                          "SLURM login node, or use --cluster local to run the job on this "
                          "machine")
    if args.cluster == "local" and args.nodes != 1:
        raise ConfigError(f"--cluster local runs on this machine: --nodes 1, not {args.nodes}")
    if args.signal_delay >= args.timeout * 60:
        raise ConfigError(f"--signal-delay {args.signal_delay} s is not shorter than "
                          f"--timeout {args.timeout} min")


def submit(args: argparse.Namespace, train_argv: list[str]) -> tuple[Any, Any]:
    """Check everything, then submit :class:`~detr_irpe.cli.submit_job.TrainJob`.

    Returns:
        ``(job, cfg)``: the submitit job and the run's config.
    """
    submitit = _import_submitit()
    _check_cluster(args)
    cfg = _check_training(train_argv)
    job_dir = args.job_dir or Path(cfg.train.output_dir) / "submitit"
    ensure_writable_folder(job_dir, "job folder", "choose another --job-dir")
    executor = submitit.AutoExecutor(folder=job_dir, cluster=args.cluster,
                                     slurm_max_num_timeout=args.max_requeues,
                                     local_max_num_timeout=args.max_requeues)
    executor.update_parameters(**executor_parameters(args, cfg))
    return executor.submit(TrainJob(train_argv, cfg.train.output_dir)), cfg


def _describe(job: Any, args: argparse.Namespace, cfg: Any) -> list[str]:
    where = "this machine" if args.cluster == "local" else (
        f"partition {args.partition}" if args.partition else "the default partition")
    gpus = f"{args.gpus_per_node} GPUs" if args.gpus_per_node else "no GPU"
    return [
        f"submitted job {job.job_id}: {args.nodes} node(s) x {gpus}, {where}, "
        f"{args.timeout} min per job; run folder {cfg.train.output_dir}",
        f"  logs: {job.paths.stdout} and {job.paths.stderr} (one pair per task)",
        f"  requeued at a time-out (up to {args.max_requeues} times) or a preemption, "
        "resuming where it stopped"
        + (f"; stop it with: scancel {job.job_id}" if args.cluster == "slurm" else ""),
    ]


def main(argv: list[str] | None = None) -> int:
    args, train_argv = build_parser().parse_known_args(argv)

    def body() -> int:
        job, cfg = submit(args, train_argv)
        for line in _describe(job, args, cfg):
            print(line)
        if not args.wait:
            return 0
        sys.stdout.flush()
        try:
            result = job.result()
        except Exception as err:  # submitit's failure carries the task's traceback
            print(f"job {job.job_id} failed: {str(err).strip().splitlines()[-1]}; "
                  f"see {job.paths.stderr}", file=sys.stderr)
            return 1
        print(f"job {job.job_id} done (training exit status {result})")
        return int(result)

    return run_main(body, tool="detr-irpe-submit")


__all__ = ["build_parser", "executor_parameters", "main", "submit"]


if __name__ == "__main__":  # python -m detr_irpe.cli.submit
    raise SystemExit(main())
