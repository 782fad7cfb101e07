"""Run the training side of the published DEIMv2 code on the CPU and save what
``tests/models/deimv2/test_deimv2_criterion_official.py`` and
``tests/models/deimv2/test_deimv2_optim_official.py`` compare against. Not a test, and
not run by one: it needs a checkout of the published code
(github.com/Intellindust-AI-Lab/DEIMv2) outside this repository, and the packages its
``engine`` imports (``scipy``, ``faster_coco_eval``, ``tensorboard``; ``calflops`` is
replaced by a dummy). One part per process (the published config system keeps state
between builds):

    python tests/reference_data/deimv2/make_deimv2_training_official.py --code PATH/TO/DEIMv2 \\
        --part criterion --commit 0fff8d4 \\
        --out tests/reference_data/deimv2/deimv2_criterion_official.pt
    python tests/reference_data/deimv2/make_deimv2_training_official.py --code PATH/TO/DEIMv2 \\
        --part groups --size s --commit 0fff8d4 \\
        --out tests/reference_data/deimv2/deimv2_official_param_groups.json
    (the same with --size l; the sizes are merged into one file)
    python tests/reference_data/deimv2/make_deimv2_training_official.py --code PATH/TO/DEIMv2 \\
        --part solver --commit 0fff8d4 \\
        --out tests/reference_data/deimv2/deimv2_solver_official.pt

The parts:

- ``criterion``: the detector of ``configs/deimv2/deimv2_dinov3_s_coco.yml`` (5 classes,
  30 queries, no denoising, anchors for 128 x 192; weights
  ``deimv2_weights.deimv2_state_dict`` of each key, float64) runs a training forward on
  seeded images and targets; its outputs, detached, become float64 leaves, and the
  published ``DEIMCriterion`` of that config (matcher switch at epoch 100) scores them at
  epochs 99 and 100: the weighted terms, the gradient of their sum with respect to every
  leaf, and the matches of the last layer. The published code runs in float64 after one
  change, as for D-FINE's data: its bin-index tensor was float32 whatever the input
  (``closest_left_indices.float()`` in ``engine/deim/dfine_utils.py``; made
  ``.to(gt.dtype)`` when the module is loaded here).
- ``groups``: the published optimizer of ``deimv2_dinov3_{size}_coco.yml`` (80 classes,
  random weights), built as the published solver builds it (``YAMLConfig.optimizer``,
  the regexes of ``optimizer.params``): every trainable parameter's lr and weight decay,
  the frozen parameters, the groups as written.
- ``solver``: ``engine/optim/lr_scheduler.py`` ``FlatCosineLRScheduler`` as the published
  solver builds and steps it (after ``configs/base/optimizer.yml``'s LinearWarmup, whose
  constructor sets the first step's lr; stepped after each optimizer step with the run's
  iteration) for the S and L recipes (warm-up 2000 iterations, flat 64 / 34 epochs,
  no-aug 12 / 8, 132 / 68 epochs, lr_gamma 0.5) at 40 iterations per epoch, with the
  recipe's four groups: the lr every step ran at. And ``engine/optim/ema.py``
  ``ModelEMA`` (decay 0.9999, warm-up 1000, as ``optimizer.yml``) over a small float64
  module (linear, batch norm with its integer counter, a float buffer) whose weights and
  buffers move by seeded steps: the model after each step and the average after each
  update.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import types
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "models" / "deimv2"))
from deimv2_weights import deimv2_state_dict  # noqa: E402

F64 = torch.float64
CONFIG = "configs/deimv2/deimv2_dinov3_{}_coco.yml"
NUM_CLASSES, NUM_QUERIES = 5, 30
IMAGE = (128, 192)
EPOCHS = (99, 100)
TRAIN_SEED = 7
STEPS_PER_EPOCH = 40
RECIPES = {"s": {"epochs": 132, "flat_epochs": 64, "no_aug_epochs": 12},
           "l": {"epochs": 68, "flat_epochs": 34, "no_aug_epochs": 8}}
EMA_UPDATES = 6


def images() -> torch.Tensor:
    return torch.rand(2, 3, *IMAGE, generator=torch.Generator().manual_seed(0), dtype=F64)


def targets() -> list[dict]:
    return [{"labels": torch.tensor([1, 4, 0]),
             "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.3], [0.25, 0.3, 0.2, 0.25],
                                    [0.7, 0.6, 0.1, 0.3]], dtype=F64)},
            {"labels": torch.tensor([2]),
             "boxes": torch.tensor([[0.4, 0.55, 0.5, 0.6]], dtype=F64)}]


def _import_published(code: str):
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)
    import engine  # noqa: F401
    from engine.core import YAMLConfig
    return YAMLConfig


def _float64_bins() -> None:
    """The published bin-index tensor in the input's dtype (module docstring)."""
    import engine.deim.dfine_utils as utils
    source = inspect.getsource(utils)
    patched = source.replace("closest_left_indices.float()", "closest_left_indices.to(gt.dtype)")
    assert patched != source, "the published dfine_utils changed: check the patch"
    exec(compile(patched, utils.__file__, "exec"), utils.__dict__)  # noqa: S102


def _leaves(out: dict) -> dict[str, torch.Tensor]:
    """The tensors of a training output by dotted key, detached, as float64 leaves; the
    teachers (the last layer's tensors) left out."""
    flat = {}
    for key in ("pred_logits", "pred_boxes", "pred_corners", "ref_points", "up", "reg_scale"):
        flat[key] = out[key]
    for i, aux in enumerate(out["aux_outputs"]):
        for key in ("pred_logits", "pred_boxes", "pred_corners", "ref_points"):
            flat[f"aux_outputs.{i}.{key}"] = aux[key]
    for key in ("pred_logits", "pred_boxes"):
        flat[f"pre_outputs.{key}"] = out["pre_outputs"][key]
    for i, enc in enumerate(out["enc_aux_outputs"]):
        for key in ("pred_logits", "pred_boxes"):
            flat[f"enc_aux_outputs.{i}.{key}"] = enc[key]
    return {k: v.detach().clone() for k, v in flat.items()}


def training_outputs(leaves: dict[str, torch.Tensor], class_agnostic: bool = False) -> dict:
    """The published training-output dict from :func:`_leaves`' tensors (the teacher of
    every aux layer is the last layer's tensor itself, as in the model)."""
    layers = 1 + len({k.split(".")[1] for k in leaves if k.startswith("aux_outputs.")})
    out = {k: leaves[k] for k in ("pred_logits", "pred_boxes", "pred_corners", "ref_points",
                                  "up", "reg_scale")}
    out["aux_outputs"] = [
        {**{k: leaves[f"aux_outputs.{i}.{k}"]
            for k in ("pred_logits", "pred_boxes", "pred_corners", "ref_points")},
         "teacher_corners": leaves["pred_corners"], "teacher_logits": leaves["pred_logits"]}
        for i in range(layers - 1)]
    out["pre_outputs"] = {k: leaves[f"pre_outputs.{k}"] for k in ("pred_logits", "pred_boxes")}
    encs = len({k.split(".")[1] for k in leaves if k.startswith("enc_aux_outputs.")})
    out["enc_aux_outputs"] = [{k: leaves[f"enc_aux_outputs.{i}.{k}"]
                               for k in ("pred_logits", "pred_boxes")} for i in range(encs)]
    out["enc_meta"] = {"class_agnostic": class_agnostic}
    return out


def _criterion(code: str, commit: str, out_path: Path) -> None:
    yaml_config = _import_published(code)
    _float64_bins()
    cfg = yaml_config(CONFIG.format("s"), HGNetv2={"pretrained": False},
                      num_classes=NUM_CLASSES, eval_spatial_size=list(IMAGE),
                      DEIMTransformer={"num_queries": NUM_QUERIES, "num_denoising": 0})
    model = cfg.model.double()
    model.load_state_dict(deimv2_state_dict(model.state_dict()), strict=True)
    vit = model.backbone.dinov3
    (vit._model if hasattr(vit, "_model") else vit).rope_embed.dtype = F64
    model.train()
    torch.manual_seed(TRAIN_SEED)
    leaves = _leaves(model(images(), targets()))
    criterion = cfg.criterion.train()
    record = {"commit": commit, "config": CONFIG.format("s"), "num_classes": NUM_CLASSES,
              "num_queries": NUM_QUERIES, "image_shape": [2, 3, *IMAGE],
              "matcher_change_epoch": criterion.matcher.matcher_change_epoch,
              "iou_order_alpha": criterion.matcher.iou_order_alpha,
              "weight_dict": dict(criterion.weight_dict), "leaves": leaves,
              "targets": targets(), "epochs": {}}
    for epoch in EPOCHS:
        inputs = {k: v.clone().requires_grad_(k not in ("up", "reg_scale"))
                  for k, v in leaves.items()}
        outputs = training_outputs(inputs)
        no_aux = {k: v for k, v in outputs.items() if "aux" not in k}
        matches = criterion.matcher(no_aux, targets(), epoch=epoch)["indices"]
        losses = criterion(outputs, targets(), epoch=epoch)
        sum(losses.values()).backward()
        record["epochs"][epoch] = {
            "losses": {k: v.detach() for k, v in losses.items()},
            "grads": {k: v.grad for k, v in inputs.items() if v.grad is not None},
            "matches": [[q.tolist(), t.tolist()] for q, t in matches]}
    tmp = out_path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(out_path)


def _groups(code: str, size: str, commit: str, out_path: Path) -> None:
    yaml_config = _import_published(code)
    cfg = yaml_config(CONFIG.format(size), HGNetv2={"pretrained": False})
    model = cfg.model
    optimizer = cfg.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    parameters = {names[id(p)]: [g["lr"], g["weight_decay"]]
                  for g in optimizer.param_groups for p in g["params"]}
    written = cfg.yaml_cfg["optimizer"]
    merged = json.loads(out_path.read_text()) if out_path.exists() else {}
    merged[f"deimv2_{size}"] = {
        "config": CONFIG.format(size), "lr": written["lr"],
        "weight_decay": written["weight_decay"], "betas": written["betas"],
        "groups": [{k: (v if k == "params" else float(v)) for k, v in g.items()}
                   for g in written["params"]],
        "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
        "parameters": dict(sorted(parameters.items()))}
    merged["source"] = (
        "Intellindust-AI-Lab/DEIMv2 " + (commit or merged.get("commit", "")) +
        ": the optimizer of configs/deimv2/deimv2_dinov3_{s,l}_coco.yml as its solver builds "
        "it (engine/core/yaml_config.py get_optim_params), every parameter's lr and weight "
        "decay (tests/reference_data/deimv2/make_deimv2_training_official.py)")
    merged["commit"] = commit or merged.get("commit", "")
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
    tmp.replace(out_path)


def _schedule(code: str, recipe: dict, base_lrs: list[float]) -> dict:
    from engine.optim.lr_scheduler import FlatCosineLRScheduler
    from engine.optim.warmup import LinearWarmup

    optimizer_yml = yaml.safe_load((Path(code) / "configs" / "base" / "optimizer.yml").read_text())
    base = yaml.safe_load((Path(code) / "configs" / "base" / "deimv2.yml").read_text())
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in base_lrs]
    optimizer = torch.optim.AdamW(groups)
    sched = dict(optimizer_yml["lr_scheduler"])
    assert sched.pop("type") == "MultiStepLR"
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, **sched)
    warm = dict(optimizer_yml["lr_warmup_scheduler"])
    assert warm.pop("type") == "LinearWarmup"
    LinearWarmup(lr_scheduler, **warm)
    scheduler = FlatCosineLRScheduler(
        optimizer, base["lr_gamma"], STEPS_PER_EPOCH, total_epochs=recipe["epochs"],
        warmup_iter=base["warmup_iter"], flat_epochs=recipe["flat_epochs"],
        no_aug_epochs=recipe["no_aug_epochs"])
    used = []
    for epoch in range(recipe["epochs"]):
        for i in range(STEPS_PER_EPOCH):
            used.append([g["lr"] for g in optimizer.param_groups])
            optimizer.step()
            optimizer = scheduler.step(epoch * STEPS_PER_EPOCH + i, optimizer)
    return {**recipe, "steps_per_epoch": STEPS_PER_EPOCH, "warmup_iters": base["warmup_iter"],
            "lr_gamma": base["lr_gamma"], "base_lrs": base_lrs,
            "lrs_used": torch.tensor(used, dtype=F64)}


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4))


def _ema(code: str) -> dict:
    from engine.optim.ema import ModelEMA

    ema_cfg = yaml.safe_load((Path(code) / "configs" / "base" / "optimizer.yml").read_text())["ema"]
    generator = torch.Generator().manual_seed(3)
    model = _Small().double()
    ema = ModelEMA(model, decay=ema_cfg["decay"], warmups=ema_cfg["warmups"],
                   start=ema_cfg.get("start", 0))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    steps, averages = [], []
    with torch.no_grad():
        for _ in range(EMA_UPDATES):
            for value in model.state_dict().values():
                if value.is_floating_point():
                    value.add_(torch.randn(value.shape, generator=generator, dtype=F64))
                else:
                    value.add_(1)
            steps.append({k: v.clone() for k, v in model.state_dict().items()})
            ema.update(model)
            averages.append({k: v.clone() for k, v in ema.module.state_dict().items()})
    return {"decay": ema_cfg["decay"], "warmups": ema_cfg["warmups"],
            "start_ema": ema_cfg.get("start", 0), "initial": start, "models": steps,
            "averages": averages, "updates": ema.updates}


def _solver(code: str, commit: str, out_path: Path) -> None:
    _import_published(code)
    lrs = {"s": [2.5e-5, 2.5e-5, 5e-4, 5e-4], "l": [1.25e-5, 1.25e-5, 5e-4, 5e-4]}
    record = {"commit": commit,
              "schedules": {size: _schedule(code, recipe, lrs[size])
                            for size, recipe in RECIPES.items()},
              "ema": _ema(code)}
    tmp = out_path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(out_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", required=True, help="the published repository's folder")
    parser.add_argument("--part", choices=["criterion", "groups", "solver"], required=True)
    parser.add_argument("--size", choices=list("smlx"), default="s", help="--part groups")
    parser.add_argument("--commit", default="", help="the published code's commit (recorded)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_path = Path(args.out).resolve()
    code = str(Path(args.code).resolve())
    if args.part == "criterion":
        _criterion(code, args.commit, out_path)
    elif args.part == "groups":
        _groups(code, args.size, args.commit, out_path)
    else:
        _solver(code, args.commit, out_path)


if __name__ == "__main__":
    main()
