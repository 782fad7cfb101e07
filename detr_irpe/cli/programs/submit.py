"""The program of ``detr-irpe-submit`` (:mod:`detr_irpe.cli.submit`) once its arguments are
parsed: the training's arguments and config checked, the job submitted through submitit."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli.programs.train import run_config
from detr_irpe.cli.submit_job import TrainJob
from detr_irpe.errors import ConfigError
from detr_irpe.utils.files import ensure_writable_folder


def _import_submitit() -> Any:
    try:
        import submitit  # optional dependency (the slurm extra)
    except ImportError:
        raise ConfigError("detr-irpe-submit needs submitit: pip install 'detr_irpe[slurm]' "
                          "(or pip install submitit)") from None
    return submitit


def _check_training(args: argparse.Namespace) -> Any:
    """The training's config (``args``: its parsed arguments), checked as detr-irpe-train
    would; published checkpoint names are downloaded here, where the network may be
    (compute nodes often have none), into the cache the tasks read."""
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


def submit(args: argparse.Namespace, train_argv: list[str],
           train_args: argparse.Namespace) -> tuple[Any, Any]:
    """Check everything, then submit :class:`~detr_irpe.cli.submit_job.TrainJob`
    (``train_argv``: the training's arguments, ``train_args`` as its parser read them).

    Returns:
        ``(job, cfg)``: the submitit job and the run's config.
    """
    submitit = _import_submitit()
    _check_cluster(args)
    cfg = _check_training(train_args)
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


def run(args: argparse.Namespace, train_argv: list[str],
        train_args: argparse.Namespace) -> int:
    """Submit (and with ``--wait`` wait for) the job; the exit status."""
    job, cfg = submit(args, train_argv, train_args)
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


__all__ = ["executor_parameters", "run", "submit"]
