"""RT-DETR (Zhao et al., "DETRs Beat YOLOs on Real-time Object Detection", CVPR 2024):
ResNet-vd backbone -> hybrid encoder (AIFI + CCFM) -> decoder with query selection.

The state-dict layout is the published one (``backbone.*``, ``encoder.*``, ``decoder.*``),
so a released file's state dict loads with ``strict=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.models.rtdetr.decoder import RTDETRDecoder
from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder
from detr_irpe.structures import ImageBatch


class BackboneEncoderDecoder(nn.Module):
    """Backbone, encoder and decoder of a real-time DETR (RT-DETR; D-FINE reuses it).

    Args:
        backbone: images ``(B, 3, H, W)`` -> feature maps at strides 8, 16, 32, finest
            first (:class:`~.presnet.PResNet`, an HGNetv2, or a
            :class:`~detr_irpe.models.vit.ViTBackbone`).
        encoder: those maps -> fused maps of ``hidden_dim`` channels.
        decoder: fused maps (+ targets and a generator in training) -> predictions.
        input_mean, input_std: the normalisation of the images it is given (this package's
            data pipeline: ImageNet's); they are mapped back to [0, 1] pixels, the published
            model's input. None: the images are [0, 1] pixels already.
    """

    # the stride of the coarsest map, twice upsampled by the encoder: sides must divide
    STRIDE = 32
    # the outputs (at any depth of the output dict) that hold boxes normalised by the
    # padded tensor, rescaled to each image's own size
    BOX_KEYS: tuple[str, ...] = ("pred_boxes", "enc_topk_boxes")
    # the name in messages
    TITLE = "RT-DETR"

    def __init__(self, backbone: nn.Module, encoder: nn.Module, decoder: nn.Module,
                 input_mean: Sequence[float] | None = None,
                 input_std: Sequence[float] | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.encoder = encoder
        self.decoder = decoder
        if (input_mean is None) != (input_std is None):
            raise ValueError("input_mean and input_std go together")
        mean = None if input_mean is None else torch.tensor(input_mean).view(1, 3, 1, 1)
        std = None if input_std is None else torch.tensor(input_std).view(1, 3, 1, 1)
        # not saved: a property of the input pipeline, not a weight
        self.register_buffer("input_mean", mean, persistent=False)
        self.register_buffer("input_std", std, persistent=False)

    def forward(
        self,
        images: ImageBatch | Tensor | list[Tensor],
        targets: list[dict] | None = None,
        generator: torch.Generator | None = None,
    ) -> dict:
        """Predict boxes for a batch of images.

        The model is trained and evaluated on images resized to one square size without
        padding, and, as in the published models, the network reads no padding mask (padded
        pixels count as image). Sides that are no multiple of 32 (the encoder doubles the
        coarsest map's size twice) are padded at the bottom / right; the boxes of an image
        smaller than the batch (an :class:`ImageBatch` of several sizes, or that padding)
        are then rescaled to be normalised by its own size, as every family's are. Training
        expects unpadded batches (``data.augmentation: rtdetr``): the denoising queries are
        built in the batch's frame.

        Args:
            images: an :class:`ImageBatch` (its ``tensors``), a ``(B, 3, H, W)`` tensor, or
                a list of ``(3, H, W)`` tensors (of several sizes: padded at the bottom /
                right to the largest height and width, rounded up to a multiple of 32,
                with zeros of the input, as :meth:`ImageBatch.from_images` pads; each
                image's boxes are normalised by its own size).
            targets: B dicts with ``labels`` ``(N_b,)`` int64 class indices 0..C-1 and
                ``boxes`` ``(N_b, 4)`` cxcywh normalised; needed in training for the
                denoising queries.
            generator: random source of the denoising noise (None: torch's global RNG).

        Returns:
            the decoder's dict: ``pred_logits`` ``(B, Q, C)`` sigmoid logits and
            ``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1], and the family's other outputs.
        """
        mask = None
        if isinstance(images, ImageBatch):
            x, mask = images.tensors, images.mask
        elif isinstance(images, (list, tuple)) and len({tuple(i.shape) for i in images}) > 1:
            # images of several sizes: padded at the bottom / right as the data pipeline
            # pads a batch (zeros of the normalised input), to a multiple of the stride
            batch = ImageBatch.from_images(list(images), size_divisibility=self.STRIDE)
            x, mask = batch.tensors, batch.mask
        elif isinstance(images, (list, tuple)):
            x = torch.stack(list(images))
        else:
            x = images
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"{self.TITLE} takes (B, 3, H, W) images, got {tuple(x.shape)}")
        if self.input_mean is not None:
            x = x * self.input_std.to(x.dtype) + self.input_mean.to(x.dtype)
        height, width = x.shape[-2:]
        pad_h, pad_w = -height % self.STRIDE, -width % self.STRIDE
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        out = self.decoder(self.encoder(self.backbone(x)), targets, generator)
        scale = _box_scale(mask, x.shape[0], (height, width), x.shape[-2:], x.device)
        return out if scale is None else _rescaled(out, scale, self.BOX_KEYS)


class RTDETR(BackboneEncoderDecoder):
    """Backbone, encoder and decoder of RT-DETR (:class:`BackboneEncoderDecoder`).

    Its forward returns ``pred_logits`` ``(B, Q, C)`` sigmoid logits and ``pred_boxes``
    ``(B, Q, 4)`` cxcywh in [0, 1]; in training also ``aux_outputs``, ``dn_aux_outputs``
    and ``dn_meta``, in eval mode ``enc_topk_boxes`` and ``enc_topk_logits`` (the selected
    proposals; :meth:`RTDETRDecoder.forward`).
    """

    def __init__(self, backbone: nn.Module, encoder: HybridEncoder, decoder: RTDETRDecoder,
                 input_mean: Sequence[float] | None = None,
                 input_std: Sequence[float] | None = None) -> None:
        super().__init__(backbone, encoder, decoder, input_mean, input_std)


def _box_scale(mask: Tensor | None, batch: int, size: tuple[int, int],
               padded: tuple[int, int], device: torch.device) -> Tensor | None:
    """``(B, 1, 4)`` factors from boxes normalised by the padded tensor to boxes normalised
    by each image's own size (from the padding ``mask``), None when they are all 1."""
    if mask is not None and bool(mask.any()):
        heights = (~mask).any(dim=2).sum(dim=1)
        widths = (~mask).any(dim=1).sum(dim=1)
    elif tuple(padded) != tuple(size):
        heights = torch.full((batch,), size[0], device=device)
        widths = torch.full((batch,), size[1], device=device)
    else:
        return None
    sx = padded[1] / widths.clamp(min=1).to(torch.float64)
    sy = padded[0] / heights.clamp(min=1).to(torch.float64)
    return torch.stack([sx, sy, sx, sy], dim=-1)[:, None, :]


def _rescaled(out, scale: Tensor, box_keys: tuple[str, ...]):
    """``out`` with every box output (``box_keys``, nested outputs too) multiplied by
    ``scale``."""
    if isinstance(out, dict):
        return {k: (v * scale.to(v.dtype) if k in box_keys else _rescaled(v, scale, box_keys))
                for k, v in out.items()}
    if isinstance(out, list):
        return [_rescaled(v, scale, box_keys) for v in out]
    return out


def encoder_attention(model: RTDETR) -> list[nn.Module]:
    """The AIFI layers' self-attention (:class:`~detr_irpe.attention.MultiheadAttention` on
    the stride-32 map), for the attention figures (the family's ``attention.encoder``);
    none for an encoder without them (DEIMv2's lite encoder, Atto-Pico)."""
    stacks = getattr(model.encoder, "encoder", ())
    return [layer.self_attn for stack in stacks for layer in stack.layers]
