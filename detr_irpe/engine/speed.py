"""What an evaluation reports about the model's cost: images per second, parameters and
FLOPs (docs/evaluation.md, "Speed").

- images per second: the wall time of the model's forward pass and the post-processing
  of each val batch, summed over the batches (the device synchronised before each clock
  reading), and the images of those batches; data loading, the losses and the COCO
  scoring are outside it. With several processes it is this process's rate.
- FLOPs: :class:`torch.utils.flop_counter.FlopCounterMode` on the first val image at the
  evaluated size, batch 1: two per multiply-add of the operations torch's counter knows
  (convolutions, matrix products, attention); element-wise operations, the iRPE lookups
  and gathers are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


class ForwardTimer:
    """Seconds spent in ``with timer.measure(images):`` blocks, and their images."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seconds = 0.0
        self.images = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def measure(self, images: int) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds += time.perf_counter() - start
        self.images += images

    @property
    def images_per_second(self) -> float | None:
        return self.images / self.seconds if self.seconds > 0 else None


def count_parameters(model: nn.Module) -> int:
    """Every parameter of ``model``, trained or frozen."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def count_flops(model: nn.Module, image: torch.Tensor) -> int:
    """FLOPs of one forward pass of ``model`` (in eval mode) on one ``(3, H, W)`` image.

    The parameters stop requiring gradients meanwhile: the counter's module tracker hooks
    the autograd graph of every input that requires them, and a parameter handed to a
    sub-module as an input (DAB-DETR's anchors) has none under ``no_grad``."""
    was_training = model.training
    trained = [p for p in model.parameters() if p.requires_grad]
    model.eval()
    for p in trained:
        p.requires_grad_(False)
    try:
        with FlopCounterMode(display=False) as counter:
            model([image])
    finally:
        for p in trained:
            p.requires_grad_(True)
        model.train(was_training)
    return int(counter.get_total_flops())


def speed_record(timer: ForwardTimer, model: nn.Module, image: torch.Tensor | None,
                 pipeline_seconds: float | None = None) -> dict[str, Any]:
    """The ``speed`` entry of ``metrics.json``: ``images_per_second`` (model forward +
    post-processing), ``images``, ``seconds``, ``parameters``, ``gflops`` (one image of
    ``input_size`` ``[H, W]``; None without an image); with ``pipeline_seconds`` (the
    wall time of the whole evaluation: reading and decoding, resizing, batching, the
    model, post-processing, COCO scoring) also ``pipeline_images_per_second`` and
    ``model_share`` (the model's share of that time; the rest is the pipeline's)."""
    rate = timer.images_per_second
    flops = count_flops(model, image) if image is not None else None
    pipeline = {}
    if pipeline_seconds is not None and pipeline_seconds > 0:
        pipeline = {"pipeline_seconds": round(pipeline_seconds, 4),
                    "pipeline_images_per_second": round(timer.images / pipeline_seconds, 3),
                    "model_share": round(timer.seconds / pipeline_seconds, 4)}
    return {
        **pipeline,
        "images_per_second": None if rate is None else round(rate, 3),
        "images": timer.images, "seconds": round(timer.seconds, 4),
        "parameters": count_parameters(model),
        "gflops": None if flops is None else round(flops / 1e9, 4),
        "input_size": None if image is None else list(image.shape[-2:]),
        "measures": "model forward + post-processing per val batch (no data loading, "
                    "losses or COCO scoring); FLOPs by torch.utils.flop_counter on one image",
    }


def format_speed(record: dict[str, Any]) -> str:
    """One line: ``12.3 images/s (forward + post-processing), 41.3 M parameters, 86.2
    GFLOPs at 800x1199``."""
    rate = record.get("images_per_second")
    parts = [f"{rate:.1f} images/s (model forward + post-processing)" if rate else
             "images/s not measured"]
    parts.append(f"{record['parameters'] / 1e6:.2f} M parameters")
    if record.get("gflops") is not None:
        height, width = record["input_size"]
        parts.append(f"{record['gflops']:.2f} GFLOPs at {height}x{width}")
    line = "speed: " + ", ".join(parts)
    if record.get("pipeline_images_per_second"):
        line += (f"; the whole evaluation {record['pipeline_images_per_second']:.1f} images/s "
                 "(reading, resizing, batching, model, post-processing, COCO scoring), the "
                 f"model {100 * record['model_share']:.0f} % of its time")
    return line


__all__ = ["ForwardTimer", "count_flops", "count_parameters", "format_speed", "speed_record"]
