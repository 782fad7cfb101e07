"""The DETR detector: backbone + transformer + prediction heads (Carion et al. 2020).

Adapted from DETR's ``detr.py``: the same module names and order
(``transformer``, ``class_embed``, ``bbox_embed``, ``query_embed``,
``input_proj``, ``backbone``) so public checkpoints load, with the loss and
post-processing in their own files and an :class:`ImageBatch` input.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from detr_irpe.models.backbone import Joiner
from detr_irpe.models.detr.transformer import Transformer
from detr_irpe.models.mlp import MLP
from detr_irpe.structures import ImageBatch

__all__ = ["DETR", "MLP"]  # MLP lives in models/mlp.py; importable from here as before


def predictions(logits: Tensor, boxes: Tensor, aux: bool) -> dict:
    """Every decoder layer's ``(L, B, Q, C)`` logits and ``(L, B, Q, 4)`` boxes -> the last
    layer's as ``pred_logits`` / ``pred_boxes``, and with ``aux`` the earlier layers' as
    ``aux_outputs`` (a list of dicts with the same two keys)."""
    out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
    if aux:
        out["aux_outputs"] = [
            {"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])
        ]
    return out


class DETR(nn.Module):
    """DETR: set prediction of ``num_queries`` (class, box) pairs per image.

    Args:
        backbone: a :class:`Joiner` of the ResNet and the position encoding.
        transformer: the encoder-decoder; its ``d_model`` is the hidden size.
        num_classes: largest category id + 1; the classifier has one more
            output, the last being "no object".
        num_queries: object queries (detection slots) per image.
        aux_loss: also return the predictions of every earlier decoder layer.
    """

    def __init__(
        self,
        backbone: Joiner,
        transformer: Transformer,
        num_classes: int,
        num_queries: int = 100,
        aux_loss: bool = True,
    ) -> None:
        super().__init__()
        hidden_dim = transformer.d_model
        self.num_queries = num_queries
        self.num_classes = num_classes
        self.transformer = transformer
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.bbox_embed = MLP(hidden_dim, hidden_dim, 4, 3)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.input_proj = nn.Conv2d(backbone.num_channels, hidden_dim, kernel_size=1)
        self.backbone = backbone
        self.aux_loss = aux_loss

    def forward(
        self, samples: ImageBatch | Sequence[Tensor], targets: list[dict] | None = None
    ) -> dict:
        """Predict boxes for a padded batch or a list of ``(3, H_i, W_i)`` normalised images.

        ``targets`` (the training step passes them) are not used by DETR; decoders that
        train with denoising queries take them in the same place.

        Returns a dict with
            ``pred_logits``: ``(B, Q, num_classes + 1)`` class logits;
            ``pred_boxes``: ``(B, Q, 4)`` (cx, cy, w, h) in [0, 1], relative to
            each image's un-padded size;
            ``aux_outputs`` (when ``aux_loss``): ``dec_layers - 1`` dicts with the
            same two keys, one per earlier decoder layer.
        """
        batch = samples if isinstance(samples, ImageBatch) else ImageBatch.from_images(samples)
        features, mask, pos = self.backbone(batch)
        hs, _ = self.transformer(self.input_proj(features), mask, self.query_embed.weight, pos)
        logits = self.class_embed(hs)  # (layers, B, Q, C + 1)
        return predictions(logits, self.bbox_embed(hs).sigmoid(), self.aux_loss)


def encoder_attention(model: DETR) -> list[nn.Module]:
    """The encoder layers' self-attention (:class:`~detr_irpe.attention.MultiheadAttention`),
    for the attention figures (the family's ``attention.encoder``)."""
    return [layer.self_attn for layer in model.transformer.encoder.layers]


def decoder_attention(model: DETR) -> list[nn.Module]:
    """The decoder layers' cross-attention (``nn.MultiheadAttention`` over the memory)."""
    return [layer.multihead_attn for layer in model.transformer.decoder.layers]
