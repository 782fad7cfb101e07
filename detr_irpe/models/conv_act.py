"""A convolution and the activation after it as one oneDNN call on the CPU (the inference
form, :mod:`detr_irpe.models.fusion`).

ONNX Runtime runs every ReLU / SiLU inside the convolution before it: the activation is
applied to each output tile while it is still in cache. Eager PyTorch writes the whole
feature map and reads it back for the activation. oneDNN, which runs PyTorch's CPU
convolutions, has the same fused form (a "post-op"); PyTorch reaches it through the
``mkldnn::_convolution_pointwise`` operator that its own compiler emits for the pattern.
:class:`ConvAct2d` calls it where it applies and falls back to ``act(conv(x))``
everywhere else (another device, autocast, gradients, tracing / export / compiling, a
PyTorch without oneDNN), so a model holding it runs anywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "ConvAct2d"]

# activation name -> oneDNN's post-op name
ACTIVATIONS = {"relu": "relu", "silu": "swish"}


def _mkldnn_op(name: str):
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return getattr(ops, name).default if ops is not None else None
    except (AttributeError, RuntimeError):  # a build without the operator
        return None


_POINTWISE = _mkldnn_op("_convolution_pointwise")
_REORDER = _mkldnn_op("_reorder_convolution_weight")
# input shapes whose reordered weights a block keeps (a few test sizes at once)
_PACKED_SHAPES = 4


class ConvAct2d(nn.Module):
    """``act(conv(x))`` for a convolution with zero padding and ``act`` one of
    :data:`ACTIVATIONS`; on the CPU in float32 without gradients, one oneDNN call with
    the activation fused (the same kernel as ``conv``, so the same numbers up to the
    activation's own float32 rounding), with the weight reordered once per input shape
    into the layout oneDNN runs fastest (as PyTorch's compiler does when it freezes a
    model); measured on D-FINE-L at 640 x 640, docs/benchmarks.md.

    Args:
        conv: the convolution (kept as the child ``conv``: ``.to()`` / memory formats
            apply to it as before).
        act: ``"relu"`` or ``"silu"``.
    """

    def __init__(self, conv: nn.Conv2d, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"ConvAct2d: activation must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {act!r}")
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError("ConvAct2d needs a convolution with numeric zero padding, got "
                             f"padding={conv.padding!r}, padding_mode={conv.padding_mode!r}")
        self.conv = conv
        self.act = act
        # the weight in oneDNN's blocked layout for one input shape (oneDNN picks the
        # layout for the shape): reordered once per shape, not at every call; keyed by
        # the weight's storage and version, so a changed or moved weight is reordered anew
        self._packed: dict[tuple, Tensor] = {}

    def _fused_applies(self, x: Tensor) -> bool:
        weight = self.conv.weight
        return (_POINTWISE is not None and x.device.type == "cpu"
                and x.dtype == torch.float32 and weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                and not torch.is_autocast_enabled("cpu")
                and not torch.jit.is_scripting() and not torch.jit.is_tracing()
                and not torch.onnx.is_in_onnx_export() and not torch.compiler.is_compiling())

    def __getstate__(self) -> dict:
        """Copies and pickles leave the reordered weights out (oneDNN's opaque tensors
        cannot be copied; they are made again on first use)."""
        return {**self.__dict__, "_packed": {}}

    def _weight_for(self, x: Tensor) -> Tensor:
        weight = self.conv.weight
        if _REORDER is None:
            return weight
        key = (tuple(x.shape), weight.data_ptr(), weight._version)
        packed = self._packed.get(key)
        if packed is None:
            conv = self.conv
            packed = _REORDER(weight, list(conv.padding), list(conv.stride),
                              list(conv.dilation), conv.groups, list(x.shape))
            if len(self._packed) >= _PACKED_SHAPES:
                self._packed.pop(next(iter(self._packed)))
            self._packed[key] = packed
        return packed

    def forward(self, x: Tensor) -> Tensor:
        conv = self.conv
        if self._fused_applies(x):
            return _POINTWISE(x, self._weight_for(x), conv.bias, list(conv.padding),
                              list(conv.stride), list(conv.dilation), conv.groups,
                              ACTIVATIONS[self.act], [], "")
        y = conv(x)
        return F.relu(y, inplace=True) if self.act == "relu" else F.silu(y, inplace=True)

    def extra_repr(self) -> str:
        return f"act={self.act}"
