"""A detector family of one's own, registered from a module named in ``model.import``
(docs/model.md, "A detector family of your own": the docs show this file).

The toy detector pools a small CNN's features onto a ``grid x grid`` raster; each cell is
one query with DETR's softmax classes and a box, trained with DETR's set loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from detr_irpe.config import ModelConfig
from detr_irpe.config.checks import positive
from detr_irpe.family import DetectorFamily, register_family
from detr_irpe.models.detr.build import build_criterion
from detr_irpe.models.detr.config import DETRLossConfig
from detr_irpe.models.postprocess import PostProcess
from detr_irpe.structures import ImageBatch


@dataclass
class ToyModelConfig(ModelConfig):
    FAMILY: ClassVar[str] = "toy"

    family: str = "toy"
    rpe: str = "none"
    # Queries per side: the features are pooled onto a grid x grid raster.
    grid: int = 3
    # Channels of the CNN.
    hidden_dim: int = 16
    nheads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("model.grid", self.grid)

    def feature_stride(self) -> int:
        return 4


@dataclass
class ToyLossConfig(DETRLossConfig):
    FAMILY: ClassVar[str] = "toy"


class ToyDetector(nn.Module):
    def __init__(self, num_classes: int, width: int, grid: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(grid)
        self.class_embed = nn.Linear(width, num_classes + 1)
        self.bbox_embed = nn.Linear(width, 4)

    def forward(self, images: ImageBatch | list[torch.Tensor], targets=None) -> dict:
        if not isinstance(images, ImageBatch):  # a list of (3, H, W) images
            images = ImageBatch.from_images(images)
        x = images.tensors
        cells = self.pool(self.body(x)).flatten(2).transpose(1, 2)  # (B, Q, C)
        return {"pred_logits": self.class_embed(cells),
                "pred_boxes": self.bbox_embed(cells).sigmoid()}


def build_detector(m: ToyModelConfig, load_backbone_weights: bool = True) -> ToyDetector:
    return ToyDetector(m.num_classes, m.hidden_dim, m.grid)


def build_postprocessor(m: ToyModelConfig, categories=None) -> PostProcess:
    return PostProcess(m.category_ids)


def build(m: ToyModelConfig, loss: ToyLossConfig, load_backbone_weights: bool = True,
          categories=None):
    # DETR's set loss reads dec_layers / aux_loss: one output, no auxiliary terms
    criterion = build_criterion(_OneLayer(m.num_classes), loss)
    return build_detector(m), criterion, build_postprocessor(m)


@dataclass
class _OneLayer:
    num_classes: int
    dec_layers: int = 1
    aux_loss: bool = False


FAMILY = register_family(DetectorFamily(
    name="toy",
    title="Toy grid detector",
    model_config=ToyModelConfig,
    loss_config=ToyLossConfig,
    build=build,
    build_detector=build_detector,
    build_postprocessor=build_postprocessor,
    model_types=(ToyDetector,),
    # detr-irpe-benchmark --import toy_family --targets Toy: the row and its config
    benchmark_targets={"Toy": str(Path(__file__).with_name("toy_family.yaml"))},
))
