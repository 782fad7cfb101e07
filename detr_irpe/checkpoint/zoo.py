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

- D-FINE N / S / M / L / X (the Peterande/D-FINE release, COCO) and DEIM-D-FINE N-X
  (ShihuaHuang95/DEIM; Google Drive files, fetched through Drive's direct-download
  address, which could not be tried from here). Their files carry no config and D-FINE's
  and DEIM's have the same keys: the name says which network (ReLU or SiLU) it is.

- DEIMv2 S / M / L / X, the ViT sizes (Intellindust-AI-Lab/DEIMv2 0fff8d4, the README's
  COCO "checkpoint" column: Google Drive files, fetched as DEIM's, not tried from here).
  The same weights are on the Hugging Face Hub (``Intellindust/DEIMv2_DINOv3_{S,M,L,X}_COCO``,
  a ``model.safetensors`` written by ``PyTorchModelHubMixin``); those files are not named
  here: which of the decoder's tied ``up`` / ``reg_scale`` names they keep was not seen.

Their published COCO numbers are in docs/checkpoints.md, docs/dfine.md and docs/deimv2.md.

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
    # the cache file's name when the address does not end in one (a Drive download)
    name: str | None = None
    # the detector family whose layout the file has, and the encodings (registry names)
    # whose parameters it holds: a file in the cache under this name without them is not
    # the published one and is refused (checkpoint.load.check_published)
    family: str = "detr"
    encodings: tuple[str, ...] = ()

    @property
    def file_name(self) -> str:
        return self.name or self.url.rsplit("/", 1)[-1]


_IRPE_RELEASE = "https://github.com/wkcn/iRPE-model-zoo/releases/download/1.0"
_RTDETR_RELEASE = "https://github.com/lyuwenyu/storage/releases/download/v0.1"
_DFINE_RELEASE = "https://github.com/Peterande/storage/releases/download/dfinev1.0"
# Google Drive's direct download of a file id (confirm=t: past the large-file page)
_DRIVE = "https://drive.usercontent.google.com/download?id={}&export=download&confirm=t"
# the DEIM-D-FINE COCO files of the DEIM README (ShihuaHuang95/DEIM a9aa4ad)
_DEIM_DRIVE_IDS = {
    "n": "1ZPEhiU9nhW4M5jLnYOFwTSLQC1Ugf62e",
    "s": "1tB8gVJNrfb6dhFvoHJECKOF5VpkthhfC",
    "m": "18Lj2a6UN6k_n_UzqnJyiaiLGpDzQQit8",
    "l": "1PIRf02XkrA2xAD3wEiKE2FaamZgSGTAr",
    "x": "1dPtbgtGgq1Oa7k_LgH1GXPelg1IVeu0j",
}
# the DEIMv2 COCO files of the DEIMv2 README (Intellindust-AI-Lab/DEIMv2 0fff8d4)
_DEIMV2_DRIVE_IDS = {
    "s": "1MDOh8UXD39DNSew6rDzGFp1tAVpSGJdL",
    "m": "1nPKDHrotusQ748O1cQXJfi5wdShq6bKp",
    "l": "1dRJfVHr9HtpdvaHlnQP460yPVHynMray",
    "x": "1pTiQaBGt8hwtO0mbYlJ8nE-HGztGafS7",
}
# DEIMv2's HGNetv2 sizes (the same README's table)
_DEIMV2_HGNET_DRIVE_IDS = {
    "atto": "18sRJXX3FBUigmGJ1y5Oo_DPC5C3JCgYc",
    "femto": "16hh6l9Oln9TJng4V0_HNf_Z7uYb7feds",
    "pico": "1PXpUxYSnQO-zJHtzrCPqQZ3KKatZwzFT",
    "n": "1G_Q80EVO4T7LZVPfHwZ3sT65FX5egp9K",
}

_IRPE = ("irpe",)
ZOO: dict[str, ZooEntry] = {
    "detr_r50": ZooEntry(
        "detr_r50", "https://dl.fbaipublicfiles.com/detr/detr-r50-e632da11.pth", True
    ),
    "detr_r50_irpe/rpe-2.0-product-ctx-1-k": ZooEntry(
        "detr_r50_irpe", f"{_IRPE_RELEASE}/rpe-2.0-product-ctx-1-k.pth", False,
        encodings=_IRPE),
    "detr_r50_irpe/rpe-2.0-product-ctx-1-k/300e": ZooEntry(
        "detr_r50_irpe_300e", f"{_IRPE_RELEASE}/rpe-2.0-product-ctx-1-k_300epochs.pth", False,
        encodings=_IRPE),
    "detr_r50_irpe/rpe-1.9-product-ctx-1-k": ZooEntry(
        "detr_r50_irpe_1.9", f"{_IRPE_RELEASE}/rpe-1.9-product-ctx-1-k.pth", False,
        encodings=_IRPE),
}
ZOO.update({f"rtdetr_r{depth}": ZooEntry(
    f"rtdetr_r{depth}", f"{_RTDETR_RELEASE}/rtdetr_r{depth}vd_{schedule}6x_coco_from_paddle.pth",
    False, family="rtdetr") for depth, schedule in ((18, "dec3_"), (34, "dec4_"), (50, ""),
                                                     (101, ""))})
ZOO.update({f"dfine_{size}": ZooEntry(f"dfine_{size}", f"{_DFINE_RELEASE}/dfine_{size}_coco.pth",
                                      False, family="dfine") for size in "nsmlx"})
ZOO.update({f"deim_{size}": ZooEntry(f"deim_{size}", _DRIVE.format(file_id), False,
                                     f"deim_dfine_hgnetv2_{size}_coco.pth", family="dfine")
            for size, file_id in _DEIM_DRIVE_IDS.items()})
ZOO.update({f"deimv2_{size}": ZooEntry(f"deimv2_{size}", _DRIVE.format(file_id), False,
                                       f"deimv2_dinov3_{size}_coco.pth", family="deimv2")
            for size, file_id in _DEIMV2_DRIVE_IDS.items()})
ZOO.update({f"deimv2_{size}": ZooEntry(f"deimv2_{size}", _DRIVE.format(file_id), False,
                                       f"deimv2_hgnetv2_{size}_coco.pth", family="deimv2")
            for size, file_id in _DEIMV2_HGNET_DRIVE_IDS.items()})


def zoo_entry(name: str) -> ZooEntry:
    """The entry called ``name``; a KeyError lists the names there are."""
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"no published checkpoint {name!r}; there are: {', '.join(ZOO)}") from None


__all__ = ["ZOO", "ZooEntry", "zoo_entry"]
