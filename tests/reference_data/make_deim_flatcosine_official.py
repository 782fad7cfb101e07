"""Step the published DEIM lr schedulers as the published solver does and save the lr every
optimizer step ran at (``deim_flatcosine_official.json``). Not a test, and not run by one:
it needs a checkout of the published code (github.com/ShihuaHuang95/DEIM) outside this
repository.

    python tests/reference_data/make_deim_flatcosine_official.py --code /tmp/DEIM \\
        --out tests/reference_data/deim_flatcosine_official.json

What the published solver does, in order (``engine/solver/_solver.py`` ``train`` and
``engine/solver/det_solver.py`` ``fit``): the optimizer; the ``lr_scheduler`` of
``configs/base/optimizer.yml`` (``MultiStepLR``, which records ``initial_lr``); the
``lr_warmup_scheduler`` of the same file (``LinearWarmup``, ``warmup_duration: 500``),
whose constructor steps once and so sets every group to ``lr / 500`` before the first
optimizer step; then, with ``lrsheduler: flatcosine``, ``FlatCosineLRScheduler`` (which
sets nothing in its constructor) replaces ``lr_scheduler``. The loop
(``engine/solver/det_engine.py``) takes the optimizer step, then calls
``lr_scheduler.step(epoch * len(loader) + i, optimizer)``; the warm-up scheduler is not
stepped again. So the first step runs at ``lr / 500`` and step ``k > 0`` at
``f(k - 1)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch
import yaml

CASES = [
    {"steps_per_epoch": 7, "epochs": 12, "warmup_iters": 20, "flat_epochs": 4,
     "no_aug_epochs": 2, "lr_gamma": 0.5, "base_lrs": [0.001, 0.0005]},
    {"steps_per_epoch": 5, "epochs": 9, "warmup_iters": 3, "flat_epochs": 2.5,
     "no_aug_epochs": 1, "lr_gamma": 0.25, "base_lrs": [0.001, 0.0005]},
    {"steps_per_epoch": 3, "epochs": 6, "warmup_iters": 4, "flat_epochs": 0,
     "no_aug_epochs": 0, "lr_gamma": 0.5, "base_lrs": [0.001, 0.0005]},
]


def _run(case: dict, optimizer_yml: dict, warmup_cls, flat_cosine_cls) -> dict:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr}
              for lr in case["base_lrs"]]
    optimizer = torch.optim.AdamW(groups)
    sched = dict(optimizer_yml["lr_scheduler"])
    assert sched.pop("type") == "MultiStepLR"
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, **sched)
    warm = dict(optimizer_yml["lr_warmup_scheduler"])
    assert warm.pop("type") == "LinearWarmup"
    warmup_cls(lr_scheduler, **warm)  # its constructor sets the first step's lr
    lr_scheduler = flat_cosine_cls(
        optimizer, case["lr_gamma"], case["steps_per_epoch"], total_epochs=case["epochs"],
        warmup_iter=case["warmup_iters"], flat_epochs=case["flat_epochs"],
        no_aug_epochs=case["no_aug_epochs"])
    used = []
    for epoch in range(case["epochs"]):
        cur_iters = epoch * case["steps_per_epoch"]
        for i in range(case["steps_per_epoch"]):
            used.append([g["lr"] for g in optimizer.param_groups])
            optimizer.step()
            optimizer = lr_scheduler.step(cur_iters + i, optimizer)
    return {**case, "linear_warmup_duration": warm["warmup_duration"], "lrs_used": used}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", required=True, help="the published repository's folder")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    code = Path(args.code).resolve()
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    sys.path.insert(0, str(code))
    from engine.optim.lr_scheduler import FlatCosineLRScheduler
    from engine.optim.warmup import LinearWarmup

    optimizer_yml = yaml.safe_load((code / "configs" / "base" / "optimizer.yml").read_text())
    record = {
        "source": "ShihuaHuang95/DEIM: the LinearWarmup of configs/base/optimizer.yml "
                  "(engine/optim/warmup.py; its constructor sets the first step's lr) then "
                  "engine/optim/lr_scheduler.py FlatCosineLRScheduler stepped as "
                  "engine/solver/det_engine.py steps it (after each optimizer step, with the "
                  "run's iteration); the lr each optimizer step ran at "
                  "(tests/reference_data/make_deim_flatcosine_official.py)",
        "cases": [_run(case, optimizer_yml, LinearWarmup, FlatCosineLRScheduler)
                  for case in CASES],
    }
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
