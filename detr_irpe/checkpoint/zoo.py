"""Published checkpoints: file names and download addresses, kept in this one place.

Used by ``hubconf.py`` (``torch.hub.load(..., pretrained=True)``) and by every tool that
takes a checkpoint: a name below (or an address) is downloaded once into torch.hub's
cache by :mod:`detr_irpe.checkpoint.download`, only when a user names it.

- DETR-R50 (the facebookresearch/detr model zoo, 500-epoch schedule).
- DETR-R50 with iRPE ``rpe-2.0-product-ctx-1-k`` (the iRPE paper's model zoo, 150- and
  300-epoch schedules) and ``rpe-1.9-product-ctx-1-k`` (150 epochs).
- RT-DETR v1 with ResNet-vd 18 / 34 / 50 / 101 (the lyuwenyu/RT-DETR model zoo: the
  PaddlePaddle models converted to PyTorch, 72-epoch schedule; files the published
  solver writes, whose EMA weights are the model).

Their published COCO numbers are in docs/checkpoints.md.

``check_hash``: the DETR file name ends in the first hex digits of its SHA-256, which
the download verifies (as ``torch.hub``'s ``check_hash`` does); the iRPE and RT-DETR file
names carry no hash and no published digest is known, so only their length is checked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZooEntry:
    """One published checkpoint: the config it matches, its address and whether its file
    name carries a SHA-256 prefix that ``torch.hub`` can check."""

    config: str
    url: str
    check_hash: bool

    @property
    def file_name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


_IRPE_RELEASE = "https://github.com/wkcn/iRPE-model-zoo/releases/download/1.0"
_RTDETR_RELEASE = "https://github.com/lyuwenyu/storage/releases/download/v0.1"

ZOO: dict[str, ZooEntry] = {
    "detr_r50": ZooEntry(
        "detr_r50", "https://dl.fbaipublicfiles.com/detr/detr-r50-e632da11.pth", True
    ),
    "detr_r50_irpe/rpe-2.0-product-ctx-1-k": ZooEntry(
        "detr_r50_irpe", f"{_IRPE_RELEASE}/rpe-2.0-product-ctx-1-k.pth", False
    ),
    "detr_r50_irpe/rpe-2.0-product-ctx-1-k/300e": ZooEntry(
        "detr_r50_irpe_300e", f"{_IRPE_RELEASE}/rpe-2.0-product-ctx-1-k_300epochs.pth", False
    ),
    "detr_r50_irpe/rpe-1.9-product-ctx-1-k": ZooEntry(
        "detr_r50_irpe_1.9", f"{_IRPE_RELEASE}/rpe-1.9-product-ctx-1-k.pth", False
    ),
    "rtdetr_r18": ZooEntry(
        "rtdetr_r18", f"{_RTDETR_RELEASE}/rtdetr_r18vd_dec3_6x_coco_from_paddle.pth", False
    ),
    "rtdetr_r34": ZooEntry(
        "rtdetr_r34", f"{_RTDETR_RELEASE}/rtdetr_r34vd_dec4_6x_coco_from_paddle.pth", False
    ),
    "rtdetr_r50": ZooEntry(
        "rtdetr_r50", f"{_RTDETR_RELEASE}/rtdetr_r50vd_6x_coco_from_paddle.pth", False
    ),
    "rtdetr_r101": ZooEntry(
        "rtdetr_r101", f"{_RTDETR_RELEASE}/rtdetr_r101vd_6x_coco_from_paddle.pth", False
    ),
}


def zoo_entry(name: str) -> ZooEntry:
    """The entry called ``name``; a KeyError lists the names there are."""
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"no published checkpoint {name!r}; there are: {', '.join(ZOO)}") from None


__all__ = ["ZOO", "ZooEntry", "zoo_entry"]
