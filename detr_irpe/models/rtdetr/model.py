"""RT-DETR (Zhao et al., "DETRs Beat YOLOs on Real-time Object Detection", CVPR 2024):
ResNet-vd backbone -> hybrid encoder (AIFI + CCFM) -> decoder with query selection.

The state-dict layout is the published one (``backbone.*``, ``encoder.*``, ``decoder.*``),
so a released file's state dict loads with ``strict=True``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from detr_irpe.models.rtdetr.decoder import RTDETRDecoder
from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder
from detr_irpe.models.rtdetr.presnet import PResNet
from detr_irpe.structures import ImageBatch


class RTDETR(nn.Module):
    """Backbone, encoder and decoder of RT-DETR.

    Args:
        backbone: images ``(B, 3, H, W)`` -> feature maps, finest first.
        encoder: those maps -> fused maps of ``hidden_dim`` channels.
        decoder: fused maps (+ targets in training) -> predictions.
    """

    def __init__(self, backbone: PResNet, encoder: HybridEncoder, decoder: RTDETRDecoder) -> None:
        super().__init__()
        self.backbone = backbone
        self.encoder = encoder
        self.decoder = decoder

    def forward(
        self,
        images: ImageBatch | Tensor | list[Tensor],
        targets: list[dict] | None = None,
        generator: torch.Generator | None = None,
    ) -> dict:
        """Predict boxes for a batch of images.

        RT-DETR is trained and evaluated on images resized to one square size without
        padding, and, as in the published model, nothing here reads a padding mask: an
        :class:`ImageBatch`'s ``mask`` is ignored (padded pixels count as image). Height and
        width must be multiples of 32 (the encoder doubles the coarsest map's size twice).

        Args:
            images: an :class:`ImageBatch` (its ``tensors``), a ``(B, 3, H, W)`` tensor, or
                a list of equally sized ``(3, H, W)`` tensors.
            targets: B dicts with ``labels`` ``(N_b,)`` int64 class indices 0..C-1 and
                ``boxes`` ``(N_b, 4)`` cxcywh normalised; needed in training for the
                denoising queries.
            generator: random source of the denoising noise (None: torch's global RNG).

        Returns:
            ``pred_logits`` ``(B, Q, C)`` sigmoid logits and ``pred_boxes`` ``(B, Q, 4)``
            cxcywh in [0, 1]; in training also ``aux_outputs``, ``dn_aux_outputs`` and
            ``dn_meta`` (:meth:`RTDETRDecoder.forward`).
        """
        if isinstance(images, ImageBatch):
            x = images.tensors
        elif isinstance(images, (list, tuple)):
            x = torch.stack(list(images))
        else:
            x = images
        if x.dim() != 4 or x.shape[1] != 3 or x.shape[2] % 32 or x.shape[3] % 32:
            raise ValueError(f"RT-DETR takes (B, 3, H, W) images with H and W multiples of 32, "
                             f"got {tuple(x.shape)}")
        return self.decoder(self.encoder(self.backbone(x)), targets, generator)
