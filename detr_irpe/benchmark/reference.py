"""The published DETR-with-iRPE code, measured in the same run as this project's step.

The reference implementation (microsoft/Cream, folder ``iRPE/DETR-with-iRPE``, which
builds on facebookresearch/detr) is not part of this project and is never fetched: the
user gives the folder of a checkout (``tools/benchmark.py --reference-code DIR``) and
this module imports its ``models`` and ``util`` packages from there, builds its model
with the defaults of its ``main.py`` and times the step its ``train_one_epoch`` takes:

    forward -> SetCriterion -> weighted sum -> zero_grad -> backward
    -> clip_grad_norm_(clip_max_norm = 0.1) -> AdamW step (torch's default implementation)
    -> loss.item()

on the same synthetic batch as this project's model rows. The reference has no mixed
precision, so its rows are float32 unless bf16 autocast is asked for explicitly.

Because this project's key layout is the public one, the reference model also loads this
project's weights without renaming: :func:`compare_outputs` runs both models on one
batch in eval mode and reports the largest difference of their outputs.

The reference's backbone asks torchvision for ImageNet weights (``pretrained=True`` on
the main process); while it is built here, the ResNet constructors are wrapped so that
the weights start random and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from detr_irpe.benchmark.model import StepRunner, interleave, training_state_bytes
from detr_irpe.engine.trainer import autocast_context
from detr_irpe.errors import ConfigError
from detr_irpe.family import get_family

__all__ = [
    "FAMILY", "check_reference_dir", "compare_outputs", "outputs_table", "reference_args",
    "reference_code", "reference_table", "reference_targets", "rows_of",
    "run_reference_benchmark", "step_runners",
]

# The family whose published code this module times: the model rows of its benchmark
# targets are the ones compared with the reference.
FAMILY = "detr"

# What a DETR-with-iRPE checkout must hold: (file, a text it contains, what it is)
_REQUIRED = (
    ("models/__init__.py", "build_model", "the model builder"),
    ("models/transformer.py", "enc_rpe2d", "the iRPE transformer"),
    ("models/rpe_attention", None, "the iRPE attention package"),
    ("util/misc.py", "NestedTensor", "DETR's NestedTensor"),
)
# the reference's top-level package names, imported from the checkout
_PACKAGES = ("models", "util")


def reference_targets() -> dict[str, str]:
    """``{row name: config name}`` of the model rows the reference code is compared with:
    the benchmark targets of :data:`FAMILY` in the registry (``{"DETR": "detr_r50"}``)."""
    return dict(get_family(FAMILY).benchmark_targets)


def check_reference_dir(path: str | Path) -> Path:
    """The checkout folder, resolved, after checking it holds the DETR-with-iRPE code.

    Raises:
        ConfigError: naming the folder and the first missing piece.
    """
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"--reference-code {path}: not a folder (give the DETR-with-iRPE "
                          "folder of a microsoft/Cream checkout, the one holding main.py)")
    for rel, marker, what in _REQUIRED:
        item = root / rel
        if not item.exists():
            raise ConfigError(f"--reference-code {root}: {rel} ({what}) not found; give the "
                              "iRPE/DETR-with-iRPE folder of a microsoft/Cream checkout")
        if marker is not None and marker not in item.read_text(errors="replace"):
            raise ConfigError(f"--reference-code {root}: {rel} has no {marker!r}; this is not "
                              "the DETR-with-iRPE code")
    return root


@contextlib.contextmanager
def _imported_from(root: Path) -> Iterator[Any]:
    """The checkout's ``models`` package, imported from ``root``.

    ``root`` is on ``sys.path`` only while ``models`` and ``util.misc`` are imported, so
    that nothing imported later (by this project or a library) can pick up a module of
    the checkout by name. On exit every module that came from the checkout is
    forgotten again.
    """
    clashes = [name for name in _PACKAGES if name in sys.modules]
    if clashes:
        raise ConfigError(f"cannot import the reference code from {root}: modules named "
                          f"{clashes} are already imported in this process")
    before = set(sys.modules)
    sys.path.insert(0, str(root))
    try:
        try:
            # a user's checkout, importable only while it is on sys.path (not a dependency)
            import models  # the checkout's package
            import util.misc  # noqa: F401  (NestedTensor, used by the steps)
        except Exception as err:
            raise ConfigError(
                f"--reference-code {root}: importing its models failed: "
                f"{type(err).__name__}: {err} (docs/benchmarks.md says what a checkout "
                "needs for this torch / torchvision)") from err
        finally:
            sys.path.remove(str(root))
        yield models
    finally:
        for name in set(sys.modules) - before:
            file = getattr(sys.modules[name], "__file__", None)
            if name.split(".")[0] in _PACKAGES or (file and Path(file).resolve().is_relative_to(root)):
                del sys.modules[name]


@contextlib.contextmanager
def _random_resnets() -> Iterator[None]:
    """torchvision's ResNet constructors, accepting the reference's ``pretrained=``
    argument and always starting from random weights (no download)."""
    names = ("resnet18", "resnet34", "resnet50", "resnet101")
    originals = {name: getattr(torchvision.models, name) for name in names}

    def wrap(build: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        def random_resnet(*args: Any, pretrained: bool = False, **kwargs: Any) -> nn.Module:
            kwargs["weights"] = None
            return build(*args, **kwargs)
        return random_resnet

    for name, build in originals.items():
        setattr(torchvision.models, name, wrap(build))
    try:
        yield
    finally:
        for name, build in originals.items():
            setattr(torchvision.models, name, build)


def reference_args(rpe: str, device: str = "cpu", **changes: Any) -> argparse.Namespace:
    """The reference ``main.py`` defaults (COCO, ResNet-50, 6 + 6 layers, aux loss) with
    ``enc_rpe2d=rpe`` (``""`` for ``rpe="none"``: the plain DETR transformer) and
    ``changes`` (e.g. a smaller model for tests) applied over them."""
    args = argparse.Namespace(
        lr=1e-4, lr_backbone=1e-5, batch_size=2, weight_decay=1e-4, epochs=300, lr_drop=200,
        clip_max_norm=0.1, frozen_weights=None, backbone="resnet50", dilation=False,
        position_embedding="sine", enc_layers=6, dec_layers=6, dim_feedforward=2048,
        hidden_dim=256, dropout=0.1, nheads=8, num_queries=100, pre_norm=False,
        enc_rpe2d="" if rpe == "none" else rpe, masks=False, aux_loss=True,
        set_cost_class=1.0, set_cost_bbox=5.0, set_cost_giou=2.0, mask_loss_coef=1.0,
        dice_loss_coef=1.0, bbox_loss_coef=5.0, giou_loss_coef=2.0, eos_coef=0.1,
        dataset_file="coco", coco_path=None, coco_panoptic_path=None, remove_difficult=False,
        output_dir="", device=device, seed=42, resume="", start_epoch=0, eval=False,
        num_workers=2, world_size=1, dist_url="env://", distributed=False,
    )
    unknown = sorted(set(changes) - set(vars(args)))
    if unknown:
        raise ConfigError(f"reference arguments {unknown} do not exist in its main.py")
    vars(args).update(changes)
    return args


def _build(models: Any, rpe: str, dev: torch.device, changes: dict[str, Any]
           ) -> tuple[nn.Module, nn.Module, Any, argparse.Namespace]:
    args = reference_args(rpe, str(dev), **changes)
    torch.manual_seed(0)
    with _random_resnets():
        model, criterion, _ = models.build_model(args)
    model.to(dev)
    criterion.to(dev)
    # the reference main.py's parameter groups and optimizer
    groups = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay)
    return model, criterion, optimizer, args


def _nested(images: Any) -> Any:
    # the user's checkout (imported by _imported_from), never importable at module level
    from util.misc import NestedTensor

    return NestedTensor(images.tensors, images.mask)


def _reference_step(model, criterion, optimizer, samples, targets, dev, amp, clip) -> float:
    with autocast_context(dev, amp):
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        weights = criterion.weight_dict
        losses = sum(loss_dict[k] * weights[k] for k in loss_dict if k in weights)
    optimizer.zero_grad()
    losses.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return float(losses.item())


@contextlib.contextmanager
def reference_code(reference_dir: str | Path) -> Iterator[Any]:
    """The checkout's ``models`` package, checked and imported, for the ``with`` block."""
    root = check_reference_dir(reference_dir)
    with _imported_from(root) as models:
        yield models


def step_runners(
    ref_models: Any,
    batch_data: tuple[Any, list[dict[str, Any]]],
    models: Sequence[str],
    device: str = "cpu",
    amp: Sequence[str] = ("none",),
    changes: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[StepRunner]:
    """One :class:`~detr_irpe.benchmark.model.StepRunner` per (``model.rpe``, precision)
    of the reference code, to be timed by :func:`~detr_irpe.benchmark.model.interleave`
    (alone or together with this project's models) inside :func:`reference_code`.

    Args:
        ref_models: the package :func:`reference_code` yields.
        batch_data: ``(ImageBatch, targets)`` as the model rows use (on ``device``).
        models: ``model.rpe`` values; ``"none"`` builds the reference's plain transformer.
        amp: precisions (``none`` = float32, the reference's own; ``bf16`` wraps its
            forward and loss in autocast, which the reference code does not do itself).
        changes: reference arguments changed from its defaults (:func:`reference_args`).
    """
    dev = torch.device(device)
    images, targets = batch_data
    samples = _nested(images)
    ref_targets = [{"labels": t["labels"], "boxes": t["boxes"]} for t in targets]
    runners = []
    for rpe in models:
        for precision in amp:
            if progress is not None:
                progress(f"building the reference DETR-with-iRPE enc_rpe2d={rpe} amp={precision}")
            model, criterion, optimizer, args = _build(ref_models, rpe, dev, changes or {})
            model.train()
            step = partial(_reference_step, model, criterion, optimizer, samples, ref_targets,
                           dev, precision, args.clip_max_norm)
            runners.append(StepRunner(
                {"impl": "reference", "rpe": rpe, "amp": precision,
                 "batch": images.tensors.shape[0], "image_hw": list(images.tensors.shape[-2:])},
                step, resident=partial(training_state_bytes, model, optimizer)))
    return runners


def rows_of(runners: Sequence[StepRunner], warmup: int) -> list[dict[str, Any]]:
    """The reference rows (the model rows' keys that apply) of timed runners."""
    return [{**r.row, **r.timing(warmup)} for r in runners]


def run_reference_benchmark(
    reference_dir: str | Path,
    batch_data: tuple[Any, list[dict[str, Any]]],
    models: Sequence[str],
    device: str = "cpu",
    train_repeats: int = 3,
    train_warmup: int = 1,
    amp: Sequence[str] = ("none",),
    changes: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Training-step seconds of the reference code alone, for each ``model.rpe`` value
    and precision (arguments as :func:`step_runners`).

    Returns:
        one dict per (model, amp): ``impl="reference"``, ``rpe``, ``amp``, ``batch``,
        ``image_hw``, ``train_step_s`` (median), ``train_step_s_all``, ``train_cpu_s``,
        ``loss_after``, ``loss_steps``, ``peak_train_mib`` (CUDA only).
    """
    with reference_code(reference_dir) as ref_models:
        runners = step_runners(ref_models, batch_data, models, device, amp, changes, progress)
        interleave(runners, train_warmup + train_repeats, torch.device(device), progress)
    return rows_of(runners, train_warmup)


def compare_outputs(
    reference_dir: str | Path,
    model: nn.Module,
    rpe: str,
    images: Any,
    device: str = "cpu",
    changes: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Load ``model``'s weights (this project's, public key layout) into the reference
    model and run both on ``images`` in eval mode, float32.

    Returns:
        ``{"logits": max |diff|, "boxes": max |diff|, "missing": n, "unexpected": n}``:
        the largest absolute differences of the final ``pred_logits`` / ``pred_boxes``
        and the keys the reference model lacks / does not know (both 0 when the layouts
        agree).
    """
    root = check_reference_dir(reference_dir)
    dev = torch.device(device)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with _imported_from(root) as ref_models:
        reference, _, _, _ = _build(ref_models, rpe, dev, changes or {})
        result = reference.load_state_dict(state, strict=False)
        reference.eval()
        model.eval()
        with torch.no_grad():
            ours = model(images.to(dev))
            theirs = reference(_nested(images.to(dev)))
    return {
        "logits": float((ours["pred_logits"] - theirs["pred_logits"]).abs().max()),
        "boxes": float((ours["pred_boxes"] - theirs["pred_boxes"]).abs().max()),
        "missing": len(result.missing_keys),
        "unexpected": len(result.unexpected_keys),
    }


def reference_table(rows: Sequence[dict[str, Any]], reference_rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: the reference rows, then this project's rows of the same models, each
    against the reference's float32 step of the same model (process CPU time and wall)."""
    base = {r["rpe"]: r for r in reference_rows if r.get("amp", "none") == "none"}
    lines = ["| code | model | precision | train step s | train CPU s | x reference fp32 (CPU) "
             "| x reference fp32 (wall) | loss after N |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    ordered = [*reference_rows, *(r for r in rows if r["rpe"] in base)]
    for r in ordered:
        ref = base.get(r["rpe"])
        name = "DETR-R50" if r["rpe"] == "none" else f"DETR-R50-iRPE {r['rpe']}"
        amp = r.get("amp", "none")
        x_cpu = "n/a" if ref is None else f"{r['train_cpu_s'] / ref['train_cpu_s']:.3f}"
        x_wall = "n/a" if ref is None else f"{r['train_step_s'] / ref['train_step_s']:.3f}"
        lines.append(
            f"| {'reference' if r.get('impl') == 'reference' else 'this project'} | {name} | "
            f"{'fp32' if amp == 'none' else amp} | {r['train_step_s']:.3f} | "
            f"{r['train_cpu_s']:.3f} | {x_cpu} | {x_wall} | "
            f"{r['loss_after']:.4f} (N={r['loss_steps']}) |"
        )
    return "\n".join(lines)


def outputs_table(checks: Sequence[dict[str, Any]]) -> str:
    """Markdown: this project's weights in the reference model, eval mode, float32."""
    lines = ["Same weights in both models (this project's state dict loaded into the "
             "reference model), eval mode, float32:\n",
             "| model | keys missing / unexpected in the reference | max abs diff pred_logits "
             "| max abs diff pred_boxes |", "|---|---:|---:|---:|"]
    for c in checks:
        name = "DETR-R50" if c["rpe"] == "none" else f"DETR-R50-iRPE {c['rpe']}"
        lines.append(f"| {name} | {c['missing']} / {c['unexpected']} | {c['logits']:.2e} | "
                     f"{c['boxes']:.2e} |")
    return "\n".join(lines)
