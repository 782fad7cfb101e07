"""Small building blocks shared by RT-DETR's backbone and encoder.

:class:`ConvNormLayer` is the conv + BatchNorm (+ activation) unit that both the
ResNet-vd backbone and the hybrid encoder are made of; its submodule names (``conv``,
``norm``) are those of the published RT-DETR state dicts.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("relu", "silu", "gelu")


def activation_fn(name: str | None, inplace: bool = False):
    """``None`` (identity) or one of :data:`ACTIVATIONS` as a function; ``inplace``: one
    that overwrites its input where PyTorch has such a form (ReLU, SiLU; the inference
    form, :mod:`detr_irpe.models.fusion`)."""
    if name is None:
        return _identity
    table = {"relu": F.relu_ if inplace else F.relu,
             "silu": _silu_ if inplace else F.silu, "gelu": F.gelu}
    if name not in table:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return table[name]


def _identity(x: Tensor) -> Tensor:
    return x


def _silu_(x: Tensor) -> Tensor:
    return F.silu(x, inplace=True)


class ConvNormLayer(nn.Module):
    """``act(norm(conv(x)))``: a bias-free ``k x k`` conv with "same" padding
    (``(k - 1) // 2``), a BatchNorm and an optional activation.

    Args:
        ch_in, ch_out: channels.
        kernel_size, stride: of the conv.
        act: ``None``, ``"relu"``, ``"silu"`` or ``"gelu"``.
        norm_layer: the norm's class (``nn.BatchNorm2d`` or a frozen one).
        groups: of the conv (``ch_in``: depthwise).
    """

    def __init__(
        self,
        ch_in: int,
        ch_out: int,
        kernel_size: int,
        stride: int = 1,
        act: str | None = None,
        norm_layer: type[nn.Module] = nn.BatchNorm2d,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch_in, ch_out, kernel_size, stride,
                              padding=(kernel_size - 1) // 2, groups=groups, bias=False)
        self.norm = norm_layer(ch_out)
        self.act_name = act
        self._act = activation_fn(act)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` -> ``(B, ch_out, H', W')``."""
        return self._act(self.norm(self.conv(x)))

    def fusable_pairs(self) -> list[tuple[str, str]]:
        """The norm follows the conv (:func:`detr_irpe.models.fusion.fuse_for_inference`)."""
        return [("conv", "norm")]

    def fuse(self) -> bool:
        """Once the norm is folded into the conv (the inference form), the activation
        runs in place on the conv's fresh output (one allocation less per call; such a
        model is for inference without gradients). Nothing is merged: returns False."""
        if isinstance(self.norm, nn.Identity):
            self._act = activation_fn(self.act_name, inplace=True)
        return False

    def extra_repr(self) -> str:
        return f"act={self.act_name}"

