"""HGNetv2 backbones B0-B6 (PaddleDetection's PP-HGNetV2, the backbone of D-FINE and DEIM),
taken from timm (the ``timm`` extra) rather than written again.

timm's ``hgnetv2_b0`` ... ``hgnetv2_b6`` are the same networks with the same parameter
names as the published D-FINE code (``stem.stem1.conv.weight``,
``stages.2.blocks.0.layers.1.conv2.lab.scale``, ...): with the same weights their four
stage outputs were equal in float64, to the last bit, for B0 and B4 (run on the CPU
against Peterande/D-FINE's ``src/nn/backbone/hgnetv2.py``), and the state-dict keys and
shapes of all seven sizes are the published ones (``tests/reference_data/
hgnetv2_official_keys.json``). The learnable affine blocks (``lab``) come with B0-B3 and
not with B4-B6, as the published sizes use them.

:class:`HGNetv2` keeps timm's ``stem`` and ``stages`` (not ``features_only``, which renames
``stages.N`` to ``stages_N``) and drops its classifier head, so that the published
ImageNet files (``PPHGNetV2_B{0..6}_stage1.pth``) and the backbones of D-FINE / DEIM
checkpoints (``backbone.*``) load by name.

DEIMv2's three-stage sizes Atto, Femto and Pico (:data:`LITE_SIZES`; the published
``engine/backbone/hgnetv2.py`` of Intellindust-AI-Lab/DEIMv2) are B0's stem and first two
stages with a narrower or shallower third stage and no fourth: they are built here from
timm's stem and stage modules (timm has no such network), with the same keys. Their
published ImageNet start is B0's file, of which they load the keys that fit
(:func:`load_hgnetv2_weights`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.models.backbone import FrozenBatchNorm2d, backbone_state_of, state_fit_problem

logger = logging.getLogger(__name__)

__all__ = ["HGNETV2_CHANNELS", "HGNETV2_SIZES", "HGNETV2_URLS", "LAB_SIZES", "LITE_CHANNELS",
           "LITE_SIZES", "LITE_STAGES", "HGNetv2", "hgnetv2_settings", "load_hgnetv2_weights"]

HGNETV2_SIZES = ("b0", "b1", "b2", "b3", "b4", "b5", "b6")
# size -> output channels of the four stages (strides 4, 8, 16, 32)
HGNETV2_CHANNELS: dict[str, tuple[int, int, int, int]] = {
    "b0": (64, 256, 512, 1024),
    "b1": (64, 256, 512, 1024),
    "b2": (96, 384, 768, 1536),
    "b3": (128, 512, 1024, 2048),
    "b4": (128, 512, 1024, 2048),
    "b5": (128, 512, 1024, 2048),
    "b6": (192, 512, 1024, 2048),
}
# the sizes built with learnable affine blocks unless told otherwise (timm's and D-FINE's)
LAB_SIZES = ("b0", "b1", "b2", "b3")
# DEIMv2's three-stage sizes (module docstring): B0's stem (16, 16) and first two stages,
# then their own third stage, each ``[in, mid, out, blocks, downsample, light block, kernel,
# layers per block]`` as timm writes a stage; learnable affine blocks unless told otherwise
_B0_STAGES = ([16, 16, 64, 1, False, False, 3, 3], [64, 32, 256, 1, True, False, 3, 3])
LITE_STAGES: dict[str, tuple[list, ...]] = {
    "atto": (*_B0_STAGES, [256, 64, 256, 1, True, True, 3, 3]),
    "femto": (*_B0_STAGES, [256, 64, 512, 1, True, True, 5, 3]),
    "pico": (*_B0_STAGES, [256, 64, 512, 2, True, True, 5, 3]),
}
LITE_SIZES = tuple(LITE_STAGES)
# size -> output channels of the three stages (strides 4, 8, 16)
LITE_CHANNELS: dict[str, tuple[int, int, int]] = {
    size: tuple(stage[2] for stage in stages) for size, stages in LITE_STAGES.items()}
# The published ImageNet files (the D-FINE release; a download only where a user asks)
HGNETV2_URLS = {size: "https://github.com/Peterande/storage/releases/download/dfinev1.0/"
                      f"PPHGNetV2_{size.upper()}_stage1.pth" for size in HGNETV2_SIZES}


def _timm():
    if importlib.util.find_spec("timm") is None:
        raise ConfigError("the HGNetv2 backbones come from timm: pip install "
                          "'detr_irpe[timm]'")
    import timm  # optional (the timm extra): checked for just above

    return timm


def _model_cfgs() -> Mapping[str, Mapping]:
    """timm's settings of each HGNetv2 network (``timm.models.hgnet.model_cfgs``)."""
    timm = _timm()
    hgnet = importlib.import_module("timm.models.hgnet")
    cfgs = getattr(hgnet, "model_cfgs", None)
    if not isinstance(cfgs, Mapping) or "hgnetv2_b0" not in cfgs:
        raise ConfigError(f"timm {timm.__version__} does not expose the HGNetv2 network "
                          "settings; upgrade it (tested with timm 1.0.31): pip install -U timm")
    return cfgs


def hgnetv2_settings(size: str) -> tuple[list[int], list[list]]:
    """``(stem widths, stages)`` of HGNetv2 ``size`` as timm builds it: the stem's two
    output widths, and per stage ``[in, mid, out, blocks, downsample, light block, kernel,
    layers per block]``."""
    cfg = _model_cfgs()[f"hgnetv2_{size}"]
    return list(cfg["stem_chs"]), [list(cfg[f"stage{i}"]) for i in range(1, 5)]


def _network(size: str, use_lab: bool | None) -> nn.Module:
    """timm's ``hgnetv2_<size>`` without a classifier; ``use_lab`` None: the size's own
    setting (:data:`LAB_SIZES`), else built from timm's settings with that choice
    (``timm.create_model`` fixes it per size)."""
    timm = _timm()
    if use_lab is None or use_lab == (size in LAB_SIZES):
        return timm.create_model(f"hgnetv2_{size}", pretrained=False, num_classes=0)
    hgnet = importlib.import_module("timm.models.hgnet")
    return hgnet.HighPerfGpuNet(_model_cfgs()[f"hgnetv2_{size}"], num_classes=0,
                                use_lab=use_lab)


def _lite_network(size: str, use_lab: bool | None) -> nn.Module:
    """The three-stage network ``size`` of :data:`LITE_STAGES` from timm's ``StemV2`` and
    ``HighPerfGpuStage`` (as timm's ``hgnetv2_b0`` builds its first stages: SE aggregation,
    no drop path, Kaiming-normal convs); ``use_lab`` None: on."""
    _timm()
    hgnet = importlib.import_module("timm.models.hgnet")
    lab = True if use_lab is None else use_lab
    net = nn.Module()
    net.stem = hgnet.StemV2(3, 16, 16, use_lab=lab)
    net.stages = nn.Sequential(*[
        hgnet.HighPerfGpuStage(in_chs, mid_chs, out_chs, blocks, layers, downsample=downsample,
                               light_block=light, kernel_size=kernel, use_lab=lab, agg="se")
        for in_chs, mid_chs, out_chs, blocks, downsample, light, kernel, layers
        in LITE_STAGES[size]])
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    return net


def _freeze_norms(module: nn.Module) -> nn.Module:
    """Every ``BatchNorm2d`` below ``module`` replaced by a :class:`FrozenBatchNorm2d` with
    its statistics (the published ``freeze_norm``)."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
            with torch.no_grad():
                for key in ("weight", "bias", "running_mean", "running_var"):
                    getattr(frozen, key).copy_(getattr(child, key))
            setattr(module, name, frozen)
        else:
            _freeze_norms(child)
    return module


class HGNetv2(nn.Module):
    """An HGNetv2 backbone: images -> the stage outputs of ``return_idx``.

    Args:
        size: ``b0`` ... ``b6``, or DEIMv2's three-stage ``atto``, ``femto``, ``pico``.
        return_idx: the stages whose outputs are returned (0-3: strides 4, 8, 16, 32;
            D-FINE N: ``(2, 3)``, S-X: ``(1, 2, 3)``; the three-stage sizes: 0-2, DEIMv2
            ``(2,)``).
        freeze_at: -1: nothing frozen; 0: the stem frozen (``requires_grad`` off) and, with
            ``freeze_stem_only`` false, the stages up to ``freeze_at`` too.
        freeze_stem_only: with ``freeze_at >= 0``, freeze the stem alone (published).
        freeze_norm: every batch norm frozen (statistics and affine values fixed).
        use_lab: the learnable affine blocks after the activated convs; None: the size's
            own (on for B0-B3, :data:`LAB_SIZES`, as D-FINE and DEIM publish them, and for
            the three-stage sizes).

    Attributes:
        out_channels, strides: of the returned maps (``out_strides``: the same strides,
            under the name the other backbones use).
    """

    def __init__(self, size: str = "b0", return_idx: Sequence[int] = (1, 2, 3),
                 freeze_at: int = -1, freeze_stem_only: bool = True,
                 freeze_norm: bool = False, *, use_lab: bool | None = None) -> None:
        super().__init__()
        if size not in HGNETV2_SIZES + LITE_SIZES:
            raise ConfigError(f"HGNetv2 size {size!r}: choose one of "
                              f"{', '.join(HGNETV2_SIZES + LITE_SIZES)}")
        channels = HGNETV2_CHANNELS[size] if size in HGNETV2_CHANNELS else LITE_CHANNELS[size]
        stages = tuple(range(len(channels)))
        if not return_idx or any(i not in stages for i in return_idx) or \
                list(return_idx) != sorted(set(return_idx)):
            raise ConfigError(f"HGNetv2 return_idx {list(return_idx)}: increasing stage "
                              f"indices out of {', '.join(map(str, stages))}")
        net = _lite_network(size, use_lab) if size in LITE_SIZES else _network(size, use_lab)
        self.size = size
        self.stem, self.stages = net.stem, net.stages
        self.return_idx = tuple(return_idx)
        self.out_channels = [channels[i] for i in self.return_idx]
        self.strides = [(4, 8, 16, 32)[i] for i in self.return_idx]
        self.out_strides = self.strides
        if freeze_at >= 0:
            frozen = [self.stem] if freeze_stem_only else [
                self.stem, *self.stages[:min(freeze_at + 1, len(self.stages))]]
            for part in frozen:
                part.requires_grad_(False)
        if freeze_norm:
            _freeze_norms(self)

    def forward(self, images: Tensor) -> list[Tensor]:
        """``(B, 3, H, W)`` -> ``[(B, out_channels[i], H / strides[i], W / strides[i])]``."""
        x = self.stem(images)
        outs = []
        for index, stage in enumerate(self.stages):
            x = stage(x)
            if index in self.return_idx:
                outs.append(x)
            if index == self.return_idx[-1]:
                break
        return outs


def load_hgnetv2_weights(backbone: HGNetv2, path: str | Path) -> None:
    """Load an HGNetv2 file into ``backbone`` by name: a published ImageNet file
    (``PPHGNetV2_B0_stage1.pth``), or a D-FINE / DEIM checkpoint's ``backbone.*`` keys.
    Classifier keys (``head.*``) are left out and ``num_batches_tracked`` is ignored.
    A three-stage size (Atto, Femto, Pico) takes the entries of a B0 file that fit it by
    name and shape (as published: B0's stem and first stages, and for Femto / Pico its
    third stage's first block), the rest starting as built (logged).

    Raises:
        CheckpointError: the file is missing or unreadable, is no state dict, or its keys
            or shapes do not fit the backbone (naming the first of them and the size).
    """
    path = str(path)
    if not Path(path).is_file():
        raise CheckpointError(f"{path}: no such HGNetv2 weights file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a broken file: one line naming it
        raise CheckpointError(f"{path}: cannot be read as a weights file ({type(err).__name__}: "
                              f"{err})") from None
    state = backbone_state_of(obj, path, "HGNetv2")
    if any(k.startswith("backbone.") for k in state):
        state = {k.removeprefix("backbone."): v for k, v in state.items()
                 if k.startswith("backbone.")}
    state = {k: v for k, v in state.items()
             if not k.startswith("head.") and not k.endswith("num_batches_tracked")}
    target = {k: v for k, v in backbone.state_dict().items()
              if not k.endswith("num_batches_tracked")}
    if backbone.size in LITE_SIZES:
        state = _fitting_part(backbone, state, target, path)
    problem = state_fit_problem(state, target)
    if problem is not None:
        raise CheckpointError(f"{path} does not fit HGNetv2-{backbone.size.upper()}: "
                              f"{problem}; is it the file of another size?")
    backbone.load_state_dict(state, strict=False)
    logger.info("loaded %d HGNetv2-%s tensors from %s", len(state), backbone.size.upper(), path)


def _fitting_part(backbone: HGNetv2, state: Mapping[str, Tensor], target: Mapping[str, Tensor],
                  path: str) -> dict[str, Tensor]:
    """The entries of ``state`` that fit a three-stage ``backbone`` by name and shape, the
    others of ``target`` filled with the built values (both logged).

    Raises:
        CheckpointError: not one entry fits.
    """
    fits = {k: v for k, v in state.items()
            if k in target and tuple(v.shape) == tuple(target[k].shape)}
    if not fits:
        raise CheckpointError(f"{path} does not fit HGNetv2-{backbone.size.upper()}: no entry "
                              "has one of its names and shapes; is it an HGNetv2 file?")
    left = [k for k in state if k not in fits]
    kept = [k for k in target if k not in fits]
    if left or kept:
        logger.info("%s: %d entries do not fit HGNetv2-%s (left out), %d of its entries start "
                    "as built", path, len(left), backbone.size.upper(), len(kept))
    return {**{k: v for k, v in target.items() if k not in fits}, **fits}
