"""The DAB-DETR detector (Liu et al., ICLR 2022), with DN-DETR's denoising queries
(Li et al., CVPR 2022) when built with ``denoising``.

The same parts as :class:`~.detr.DETR` (backbone + position encoding, ``input_proj``,
transformer, heads), with the official DAB-DETR module names so that public
checkpoints load: ``transformer``, ``class_embed`` (``num_classes`` sigmoid outputs, no
"no object"), ``label_enc`` (DN-DETR only), ``bbox_embed`` (also
``transformer.decoder.bbox_embed``: one box head refines the anchors between decoder
layers and predicts the boxes), ``refpoint_embed`` (the learnable anchors, before the
sigmoid), ``input_proj``, ``backbone``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from detr_irpe.models.backbone import Joiner
from detr_irpe.models.dab.denoising import Denoising, DenoisingNoise, build_denoising_queries
from detr_irpe.models.dab.transformer import DABTransformer, inverse_sigmoid
from detr_irpe.models.detr.model import predictions
from detr_irpe.models.mlp import MLP
from detr_irpe.structures import ImageBatch

# RetinaNet's prior: every class starts at probability 0.01, so that the focal loss of
# the many negatives does not swamp the first steps.
PRIOR_PROB = 0.01


class DABDETR(nn.Module):
    """DAB-DETR: ``num_queries`` anchor boxes refined into (class, box) predictions.

    Args:
        backbone: a :class:`Joiner` of the ResNet and the position encoding.
        transformer: the DAB encoder-decoder; its ``d_model`` is the hidden size.
        num_classes: largest category id + 1; one sigmoid score per class.
        num_queries: anchor boxes per image (300 published).
        aux_loss: also return every earlier decoder layer's predictions.
        denoising: DN-DETR's training queries (adds ``label_enc``; the matching queries'
            content then starts at ``label_enc``'s extra row instead of zero); None for
            DAB-DETR.
    """

    def __init__(
        self,
        backbone: Joiner,
        transformer: DABTransformer,
        num_classes: int,
        num_queries: int = 300,
        aux_loss: bool = True,
        denoising: Denoising | None = None,
    ) -> None:
        super().__init__()
        hidden_dim = transformer.d_model
        self.num_queries = num_queries
        self.num_classes = num_classes
        self.transformer = transformer
        self.class_embed = nn.Linear(hidden_dim, num_classes)
        if denoising is not None:
            # Row num_classes is the content of the matching queries; the last feature
            # of every query is the indicator (1 denoising, 0 matching).
            self.label_enc = nn.Embedding(num_classes + 1, hidden_dim - 1)
        self.bbox_embed = MLP(hidden_dim, hidden_dim, 4, 3)
        self.refpoint_embed = nn.Embedding(num_queries, 4)
        self.input_proj = nn.Conv2d(backbone.num_channels, hidden_dim, kernel_size=1)
        self.backbone = backbone
        self.aux_loss = aux_loss
        self.denoising = denoising
        transformer.decoder.bbox_embed = self.bbox_embed
        nn.init.constant_(self.class_embed.bias, -math.log((1 - PRIOR_PROB) / PRIOR_PROB))
        # The first boxes are the anchors themselves.
        nn.init.zeros_(self.bbox_embed.layers[-1].weight)
        nn.init.zeros_(self.bbox_embed.layers[-1].bias)

    def _matching_content(self, batch: int) -> Tensor:
        """``(B, Q, C)`` content queries of the matching part."""
        hidden = self.transformer.d_model
        weight = self.refpoint_embed.weight
        if self.denoising is None:
            return weight.new_zeros(batch, self.num_queries, hidden)
        row = torch.cat((self.label_enc.weight[self.num_classes], weight.new_zeros(1)))
        return row.expand(batch, self.num_queries, hidden)

    def forward(
        self,
        samples: ImageBatch | Sequence[Tensor],
        targets: list[dict] | None = None,
        *,
        dn_noise: DenoisingNoise | None = None,
    ) -> dict:
        """Predict boxes for a padded batch or a list of ``(3, H_i, W_i)`` normalised images.

        ``targets`` (the training step passes them) build the denoising queries in
        training mode when the model has ``denoising``; ``dn_noise`` fixes their random
        draws (default: drawn from torch's generator).

        Returns a dict with
            ``pred_logits``: ``(B, Q, num_classes)`` class logits (sigmoid scores);
            ``pred_boxes``: ``(B, Q, 4)`` (cx, cy, w, h) in [0, 1] of each un-padded image;
            ``aux_outputs`` (when ``aux_loss``): ``dec_layers - 1`` dicts of the same keys;
            ``anchors``: ``(dec_layers, B, Q, 4)`` the box each layer started from
            (sigmoid space, detached);
            with denoising queries: ``dn_outputs`` (the same three prediction keys for the
            ``P = groups * pad`` denoising queries) and ``dn_meta``
            ``{"groups": G, "pad": S}`` (ints): query ``g * S + k`` of image b
            reconstructs target k of image b.
        """
        batch = samples if isinstance(samples, ImageBatch) else ImageBatch.from_images(samples)
        features, mask, pos = self.backbone(batch)
        num_images = features.shape[0]
        anchors = self.refpoint_embed.weight.expand(num_images, -1, -1)
        content = self._matching_content(num_images)
        dn = None
        if self.training and self.denoising is not None and targets is not None:
            dn = build_denoising_queries(targets, self.denoising, self.label_enc,
                                         self.num_classes, self.num_queries, noise=dn_noise)
            anchors = torch.cat((dn.anchors, anchors), dim=1)
            content = torch.cat((dn.content, content), dim=1)
        hs, starts, _ = self.transformer(
            self.input_proj(features), mask, pos, anchors, content,
            self_attn_mask=None if dn is None else dn.attn_mask,
        )
        logits = self.class_embed(hs)  # (layers, B, P + Q, C)
        boxes = (self.bbox_embed(hs) + inverse_sigmoid(starts)).sigmoid()
        split = 0 if dn is None else dn.size
        out = predictions(logits[:, :, split:], boxes[:, :, split:], self.aux_loss)
        out["anchors"] = starts[:, :, split:].detach()
        if dn is not None:
            out["dn_outputs"] = predictions(logits[:, :, :split], boxes[:, :, :split],
                                             self.aux_loss)
            out["dn_meta"] = {"groups": dn.groups, "pad": dn.pad}
        return out


def decoder_attention(model: DABDETR) -> list[nn.Module]:
    """The decoder layers' conditional cross-attention (its ``attention_weights`` give the
    dense maps), for the attention figures (the family's ``attention.decoder``); the
    encoder's are DETR's (:func:`detr_irpe.models.detr.model.encoder_attention`)."""
    return [layer.cross_attn for layer in model.transformer.decoder.layers]
