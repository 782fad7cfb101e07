"""The per-epoch augmentation policy of DEIM's Dense O2O and D-FINE's augmentation stop
(``data.aug_policy_epochs``, ``data.mosaic_*``; docs/data.md, "Dense O2O").

With epochs ``[e0, e1, e2]`` on RT-DETR's recipe (``data.augmentation: rtdetr``):

- ``epoch < e0`` or ``epoch >= e2`` ("plain"): no photometric distortion, zoom-out, IoU
  crop or Mosaic: only the box check, the flip and the square resize;
- ``e0 <= epoch < e1`` ("mosaic"): with probability ``mosaic_prob`` Mosaic (the sample and
  three other random items of the dataset, :class:`~detr_irpe.data.mosaic.Mosaic`), then
  photometric distortion, flip and resize without zoom-out and IoU crop; otherwise
  RT-DETR's ops;
- ``e1 <= epoch < e2`` ("rtdetr"): RT-DETR's ops, no Mosaic.

D-FINE's recipe is ``[0, 0, stop]`` with ``mosaic_prob`` 0: RT-DETR's ops until ``stop``.
The dataset learns a sample's epoch from its :class:`~detr_irpe.data.sampling.SampleKey`
(``KeyedDataset`` calls ``get_for_epoch``), and every draw here comes from torch's global
generator, which ``KeyedDataset`` seeds from the key: the same key gives the same sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detr_irpe.config import DataConfig
from detr_irpe.data.mosaic import Mosaic
from detr_irpe.data.transforms import Transform, rtdetr_train_transforms

PLAIN = "plain"
MOSAIC = "mosaic"
RTDETR = "rtdetr"
STAGES = (PLAIN, MOSAIC, RTDETR)


def policy_stage(epochs: Sequence[int], epoch: int) -> str:
    """The stage of ``epoch`` under the policy ``[e0, e1, e2]``: "plain" before ``e0``
    and from ``e2`` on, "mosaic" on ``[e0, e1)``, "rtdetr" on ``[e1, e2)``."""
    e0, e1, e2 = epochs
    if epoch < e0 or epoch >= e2:
        return PLAIN
    return MOSAIC if epoch < e1 else RTDETR


class EpochPolicy:
    """The training transforms of each epoch (the module docstring).

    Args:
        epochs: ``[e0, e1, e2]``, non-decreasing.
        train_size: the square side of RT-DETR's resize.
        mosaic_prob: the probability of Mosaic for a sample of ``[e0, e1)``.
        mosaic_side: the shorter side of each of Mosaic's four images.
        hflip_prob: the probability of the flip in every stage (a Mosaic sample's too).
    """

    def __init__(self, epochs: Sequence[int], train_size: int, mosaic_prob: float = 0.0,
                 mosaic_side: int = 320, hflip_prob: float = 0.5) -> None:
        if len(epochs) != 3 or any(a > b for a, b in zip(epochs, epochs[1:])):
            raise ValueError(f"policy epochs must be 3 non-decreasing epochs, got {epochs}")
        self.epochs = [int(e) for e in epochs]
        self.mosaic_prob = float(mosaic_prob)
        self.hflip_prob = float(hflip_prob)
        self.full = rtdetr_train_transforms(train_size, hflip_prob=hflip_prob)
        self.plain = rtdetr_train_transforms(train_size, photometric=False, zoom_out=False,
                                             iou_crop=False, hflip_prob=hflip_prob)
        # after Mosaic: photometric distortion, flip and resize (no zoom-out, no IoU crop)
        self.after_mosaic = rtdetr_train_transforms(train_size, zoom_out=False, iou_crop=False,
                                                    hflip_prob=hflip_prob)
        self.mosaic = Mosaic(side=mosaic_side)

    @classmethod
    def from_config(cls, cfg: DataConfig) -> EpochPolicy | None:
        """The policy of ``data.aug_policy_epochs``, or None when it is not set."""
        if cfg.aug_policy_epochs is None:
            return None
        return cls(cfg.aug_policy_epochs, cfg.train_size, cfg.mosaic_prob, cfg.mosaic_side,
                   cfg.hflip_prob)

    def stage(self, epoch: int) -> str:
        return policy_stage(self.epochs, epoch)

    def draw_mosaic(self, epoch: int) -> bool:
        """Whether a sample of ``epoch`` is a Mosaic: drawn from torch's global generator
        on the "mosaic" epochs with ``0 < mosaic_prob``; nothing is drawn otherwise."""
        if self.stage(epoch) != MOSAIC or self.mosaic_prob <= 0.0:
            return False
        return bool(torch.rand(()) < self.mosaic_prob)

    @staticmethod
    def draw_others(count: int, num: int = 3) -> list[int]:
        """Mosaic's ``num`` other dataset indices (uniform in ``[0, count)``, repeats
        allowed, as DEIM's ``random.choice``), from torch's global generator."""
        return [int(i) for i in torch.randint(count, (num,))]

    def transforms(self, epoch: int) -> Transform:
        """The per-sample transforms of a sample of ``epoch`` that is not a Mosaic."""
        return self.plain if self.stage(epoch) == PLAIN else self.full

    def __repr__(self) -> str:
        return (f"EpochPolicy(epochs={self.epochs}, mosaic_prob={self.mosaic_prob}, "
                f"hflip_prob={self.hflip_prob}, {self.mosaic!r})")


__all__ = ["MOSAIC", "PLAIN", "RTDETR", "STAGES", "EpochPolicy", "policy_stage"]
