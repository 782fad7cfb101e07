"""Where the time of one training iteration goes: a phase table for any config.

Each phase is timed on its own with wall clocks around the engine's own step pieces
(forward hooks on the backbone, the encoder and the decoder), so the table answers
"what would pay to make faster" for the demo or a COCO config:

    data       next batch from the real train loader (augmentation, collate)
    to_device  images and targets moved to the device
    backbone / encoder / decoder / heads   the forward pass, split by module
    matcher    Hungarian matching (cost matrix + scipy)
    loss       the set loss without the matcher
    backward   autograd
    optimizer  gradient clipping + AdamW step + zero_grad

The sum of the phases is a lower bound of one iteration of the training loop; the
loop's own bookkeeping (logging, progress bar, checkpoint callbacks) is what a real
run adds on top: compare with the s/it that a run logs every ``train.print_freq`` steps.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from detr_irpe.benchmark.common import median, sync
from detr_irpe.config import load_config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.engine.trainer import model_outputs, targets_to, weighted_loss
from detr_irpe.models import build_model

__all__ = ["INFERENCE_PHASES", "PHASES", "inference_profile_table", "profile_inference",
           "profile_table", "profile_training_step"]

logger = logging.getLogger(__name__)

PHASES = ("data", "to_device", "backbone", "encoder", "decoder", "heads", "matcher", "loss",
          "backward", "optimizer")
# the phases of one eager inference call (profile_inference): the decoder's deformable
# sampling (RT-DETR, D-FINE) is its own phase, the rest of the decoder "decoder"
INFERENCE_PHASES = ("backbone", "encoder", "decoder", "deformable", "heads", "postprocess")


class _Clock:
    """Accumulates wall seconds per phase for the current iteration."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.now: dict[str, float] = defaultdict(float)
        self._open: dict[str, float] = {}

    def start(self, name: str) -> None:
        sync(self.device)
        self._open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        sync(self.device)
        self.now[name] += time.perf_counter() - self._open.pop(name)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def take(self) -> dict[str, float]:
        out, self.now = dict(self.now), defaultdict(float)
        return out


def _hook_module(module: nn.Module, name: str, clock: _Clock) -> list[Any]:
    return [
        module.register_forward_pre_hook(lambda *_: clock.start(name)),
        module.register_forward_hook(lambda *_: clock.stop(name)),
    ]


def profile_training_step(
    config: str = "synthetic_demo",
    overrides: Sequence[str] = (),
    steps: int = 20,
    warmup: int = 3,
    amp: str = "none",
    device: str = "cpu",
) -> dict[str, Any]:
    """Median seconds per phase of ``steps`` training iterations of ``config``.

    The model, loss, optimizer and train loader are the project's own
    (:func:`~detr_irpe.models.build_model`, the engine's optimizer, the data layer's
    loader), so the numbers are those of a real run minus the loop's bookkeeping.

    Returns:
        ``{"phases": {phase: median s}, "total_s": median sum, "amp": amp, ...}``.
    """
    dev = torch.device(device)
    cfg = load_config(config, list(overrides))
    dataset = build_dataset(cfg.data, "train")
    num_classes = cfg.model.num_classes or int(dataset.num_classes)
    cfg = load_config(config, [*overrides, f"model.num_classes={num_classes}"])
    torch.manual_seed(cfg.train.seed)
    model, criterion, _ = build_model(cfg)
    model.to(dev).train()
    criterion.to(dev).train()
    optimizer = build_optimizer(model, cfg.train)
    loader = build_dataloader(dataset, cfg.train.batch_size, train=True,
                              num_workers=cfg.data.num_workers, seed=cfg.train.seed)
    clock = _Clock(dev)
    hooks = []
    inner = getattr(model, "transformer", None)
    for module, name in ((model.backbone, "backbone"), (getattr(inner, "encoder", None), "encoder"),
                         (getattr(inner, "decoder", None), "decoder")):
        if module is not None:
            hooks += _hook_module(module, name, clock)
    rows: list[dict[str, float]] = []
    batches = iter(loader)
    try:
        for i in range(warmup + steps):
            with clock.phase("data"):
                try:
                    images, targets = next(batches)
                except StopIteration:
                    batches = iter(loader)
                    images, targets = next(batches)
            with clock.phase("to_device"):
                images, targets = images.to(dev), targets_to(targets, dev)
            with clock.phase("forward"):
                outputs = model_outputs(model, images, dev, amp)
            with clock.phase("matcher"):
                indices = criterion.match(outputs, targets)
            with clock.phase("loss"):
                loss = weighted_loss(criterion(outputs, targets, indices=indices),
                                     criterion.weight_dict)
            with clock.phase("backward"):
                loss.backward()
            with clock.phase("optimizer"):
                if cfg.train.clip_max_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_max_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            t = clock.take()
            t["heads"] = t.pop("forward") - t.get("backbone", 0) - t.get("encoder", 0) - t.get("decoder", 0)
            if i >= warmup:
                rows.append(t)
    finally:
        for h in hooks:
            h.remove()
    phases = {p: median([r.get(p, 0.0) for r in rows]) for p in PHASES}
    return {
        "config": config, "overrides": list(overrides), "amp": amp, "device": str(dev),
        "threads": torch.get_num_threads(), "batch_size": cfg.train.batch_size,
        "steps": steps, "phases": phases, "total_s": median([sum(r.values()) for r in rows]),
    }


def _label(result: dict[str, Any]) -> str:
    """A column title: ``label`` when the caller gave one, else the precision."""
    return result.get("label") or ("fp32" if result["amp"] == "none" else result["amp"])


def profile_table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown: one column per result (e.g. fp32 and bf16, or two configs: set a
    ``label`` key on each result), ms per phase and share."""
    head = "| phase | " + " | ".join(f"{_label(r)} ms | share" for r in results) + " |"
    rule = "|---|" + "---:|---:|" * len(results)
    lines = [head, rule]
    for phase in PHASES:
        cells = []
        for r in results:
            v = r["phases"][phase]
            cells.append(f"{1000 * v:.1f} | {100 * v / r['total_s']:.0f} %")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| **sum** | " + " | ".join(f"**{1000 * r['total_s']:.1f}** | 100 %" for r in results)
                 + " |")
    return "\n".join(lines)


def _part(model: nn.Module, name: str) -> nn.Module | None:
    """``model.<name>`` or ``model.transformer.<name>`` (DETR / DAB keep theirs there)."""
    found = getattr(model, name, None)
    if isinstance(found, nn.Module):
        return found
    inner = getattr(model, "transformer", None)
    found = getattr(inner, name, None)
    return found if isinstance(found, nn.Module) else None


def profile_inference(model: nn.Module, postprocessor: Any, images: torch.Tensor,
                      repeats: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Median seconds per phase (:data:`INFERENCE_PHASES`) of ``repeats`` eager inference
    calls of ``model`` (eval mode, ``no_grad``) on ``images`` ``(B, 3, H, W)``, the
    post-processing included: forward hooks on the backbone, the encoder, the decoder
    and each deformable-attention module inside the decoder (counted apart from the
    decoder), the rest of the forward pass is "heads".

    Returns:
        ``{"phases": {phase: median s}, "total_s": median forward + post-processing,
        "image_hw", "batch", "model"}``.
    """
    clock = _Clock(images.device)
    model = model.eval()
    hooks = []
    decoder = _part(model, "decoder")
    for module, name in ((_part(model, "backbone"), "backbone"),
                         (_part(model, "encoder"), "encoder"), (decoder, "decoder")):
        if module is not None:
            hooks += _hook_module(module, name, clock)
    deformable = [m for m in (decoder.modules() if decoder is not None else [])
                  if "Deformable" in type(m).__name__]
    for module in deformable:
        hooks += _hook_module(module, "deformable", clock)
    batch, _, height, width = images.shape
    sizes = torch.tensor([[height, width]] * batch)
    rows: list[dict[str, float]] = []
    try:
        with torch.no_grad():
            for i in range(warmup + repeats):
                with clock.phase("forward"):
                    outputs = model(list(images))
                with clock.phase("postprocess"):
                    postprocessor(outputs, sizes)
                t = clock.take()
                t["decoder"] = t.get("decoder", 0.0) - t.get("deformable", 0.0)
                t["heads"] = t.pop("forward") - t.get("backbone", 0.0) - \
                    t.get("encoder", 0.0) - t["decoder"] - t.get("deformable", 0.0)
                if i >= warmup:
                    rows.append(t)
    finally:
        for h in hooks:
            h.remove()
    return {"phases": {p: median([r.get(p, 0.0) for r in rows]) for p in INFERENCE_PHASES},
            "total_s": median([sum(r.values()) for r in rows]), "batch": batch,
            "image_hw": [height, width], "model": type(model).__name__}


def inference_profile_table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown: one column pair per profiled model (``label`` key), ms and share."""
    head = "| phase | " + " | ".join(f"{r.get('label', r['model'])} ms | share"
                                     for r in results) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(results)]
    for phase in INFERENCE_PHASES:
        cells = [f"{1000 * r['phases'][phase]:.1f} | {100 * r['phases'][phase] / r['total_s']:.0f} %"
                 for r in results]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| **sum** | " + " | ".join(f"**{1000 * r['total_s']:.1f}** | 100 %"
                                            for r in results) + " |")
    return "\n".join(lines)
