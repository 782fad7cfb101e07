"""RT-DETR's transformer decoder with IoU-aware query selection (Zhao et al., CVPR 2024,
Sec. 4.3) and contrastive denoising training.

1. Memory, anchors and query selection are the hybrid families' shared ones
   (:mod:`detr_irpe.models.hybrid.decoder`): every memory token is a proposal around
   its anchor, the ``Q`` of highest class score become the queries; their features
   (detached) are the content, their boxes (detached) the initial references. RT-DETR
   projects every level (1x1 conv + BatchNorm; extra levels 3x3 / 2).
2. Contrastive denoising queries in training come first
   (:func:`~detr_irpe.models.hybrid.denoising.contrastive_denoising`).
3. Decoder layers: self-attention (torch MHA; the position of a query is
   ``query_pos_head(reference box)``, added to queries and keys), multi-scale deformable
   cross-attention around the reference box, FFN; post-norm. After layer ``i`` the
   reference becomes ``sigmoid(dec_bbox_head[i](x) + inverse_sigmoid(reference))``, detached
   before the next layer in training (iterative box refinement).

Key names are the published ``RTDETRTransformer``'s (v1): ``input_proj.{l}.conv`` /
``.norm``, ``decoder.layers.{i}.{self_attn,cross_attn,linear1,linear2,norm1..3}``,
``denoising_class_embed``, ``query_pos_head``, ``enc_output.{0,1}``, ``enc_score_head``,
``enc_bbox_head``, ``dec_score_head.{i}``, ``dec_bbox_head.{i}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.attention.dropout import Dropout
from detr_irpe.models.box_ops import inverse_sigmoid
from detr_irpe.models.hybrid.decoder import (
    HybridDecoder,
    decoder_memory,
    feed_forward,
    generate_anchors,
    self_attention,
    split_denoising,
)
from detr_irpe.models.hybrid.settings import DecoderSettings
from detr_irpe.models.rtdetr.deformable import MSDeformableAttention

__all__ = ["DecoderLayer", "LayerStack", "RTDETRDecoder", "RTDETRDecoderSettings",
           "decoder_memory", "generate_anchors", "selected_queries"]


@dataclass(frozen=True)
class RTDETRDecoderSettings(DecoderSettings):
    """RT-DETR's decoder settings: the shared ones and ``learnt_init_query`` (learned
    content queries, ``tgt_embed``, instead of the selected proposals' features)."""

    learnt_init_query: bool = False


class DecoderLayer(nn.Module):
    """Self-attention, deformable cross-attention, FFN (ReLU), each post-norm."""

    def __init__(self, d_model: int = 256, nhead: int = 8, dim_feedforward: int = 1024,
                 dropout: float = 0.0, num_levels: int = 3, num_points: int = 4) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.cross_attn = MSDeformableAttention(d_model, nhead, num_levels, num_points)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.dropout4 = Dropout(dropout)

    def forward(self, x: Tensor, reference: Tensor, memory: Tensor,
                spatial_shapes: list[tuple[int, int]], query_pos: Tensor,
                attn_mask: Tensor | None = None) -> Tensor:
        """``x``, ``query_pos`` ``(B, Q, C)``; ``reference`` ``(B, Q, 1, 4)`` cxcywh;
        ``memory`` ``(B, L, C)``; ``attn_mask`` ``(Q, Q)`` bool, True = blocked."""
        x = self_attention(self, x, query_pos, attn_mask)
        x = self.norm2(x + self.dropout2(
            self.cross_attn(x + query_pos, reference, memory, spatial_shapes)))
        return feed_forward(self, x, F.relu)


class LayerStack(nn.Module):
    """The decoder layers (key ``layers.{i}``)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class RTDETRDecoder(HybridDecoder):
    """Query selection + decoder + heads (module docstring), built from
    :class:`RTDETRDecoderSettings` (or the shared :class:`DecoderSettings`; defaults: R50's
    256 wide, 300 queries, 3 levels of 4 points, 6 layers, 100 denoising queries)."""

    def __init__(self, settings: DecoderSettings | None = None) -> None:
        super().__init__(settings if settings is not None else RTDETRDecoderSettings())

    def build_layers(self, s: DecoderSettings) -> None:
        self.decoder = LayerStack([
            DecoderLayer(s.hidden_dim, s.nhead, s.dim_feedforward, s.dropout, s.num_levels,
                         s.num_points)
            for _ in range(s.num_layers)])

    def build_queries(self, s: DecoderSettings) -> None:
        self.learnt_init_query = getattr(s, "learnt_init_query", False)
        if self.learnt_init_query:
            self.tgt_embed = nn.Embedding(s.num_queries, s.hidden_dim)

    def build_box_heads(self, s: DecoderSettings) -> None:
        self.dec_bbox_head = nn.ModuleList(self.mlp(s.hidden_dim, s.hidden_dim, 4, 3)
                                           for _ in range(s.num_layers))

    def reset_family_parameters(self) -> None:
        if self.learnt_init_query:
            nn.init.xavier_uniform_(self.tgt_embed.weight)

    def _select_queries(self, memory: Tensor, shapes: list[tuple[int, int]]
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> content ``(B, Q, C)`` and references ``(B, Q, 4)`` unactivated (both
        detached), and the proposals' boxes ``(B, Q, 4)`` and logits ``(B, Q, C)``."""
        features, logits, anchors, top = self._proposals(memory, shapes)
        ref_unact = self.pick(self.enc_bbox_head(features) + anchors, top)
        if self.learnt_init_query:
            content = self.tgt_embed.weight[None].expand(memory.shape[0], -1, -1)
        else:
            content = self.pick(features, top).detach()
        return content, ref_unact.detach(), ref_unact.sigmoid(), self.pick(logits, top)

    def _decode(self, x: Tensor, ref_unact: Tensor, memory: Tensor,
                shapes: list[tuple[int, int]], attn_mask: Tensor | None
                ) -> dict[str, list[Tensor]]:
        """-> per decoded layer, ``boxes`` ``(B, P + Q, 4)`` and ``logits`` (eval: only
        ``eval_idx``)."""
        boxes, logits = [], []
        reference = ref_unact.sigmoid()  # what the layer sees (detached in training)
        previous = reference  # the previous layer's boxes, with their gradient
        for i, layer in enumerate(self.decoder.layers):
            x = layer(x, reference[:, :, None], memory, shapes, self.query_pos_head(reference),
                      attn_mask)
            refined = (self.dec_bbox_head[i](x) + inverse_sigmoid(reference)).sigmoid()
            if self.training:
                logits.append(self.dec_score_head[i](x))
                # from layer 1 on, the loss's boxes refine the previous boxes with their
                # gradient (the look-forward-twice scheme of DINO)
                boxes.append(refined if i == 0 else
                             (self.dec_bbox_head[i](x) + inverse_sigmoid(previous)).sigmoid())
            elif i == self.eval_idx:
                logits.append(self.dec_score_head[i](x))
                boxes.append(refined)
                break
            previous = refined
            reference = refined.detach() if self.training else refined
        return {"boxes": boxes, "logits": logits}

    def decode(self, memory: Tensor, shapes: list[tuple[int, int]],
               targets: list[dict] | None, generator: torch.Generator | None) -> dict:
        """The outputs (:meth:`~detr_irpe.models.hybrid.decoder.HybridDecoder.forward`); in
        training (``aux_loss``) also ``aux_outputs`` (every layer but the last, then the
        selected proposals: ``num_layers`` dicts), and with denoising ``dn_aux_outputs``
        (every layer's denoising queries) and ``dn_meta``
        (:func:`~detr_irpe.models.hybrid.denoising.contrastive_denoising`)."""
        content, ref_unact, enc_boxes, enc_logits = self._select_queries(memory, shapes)
        content, ref_unact, attn_mask, dn_meta = self._with_denoising(content, ref_unact,
                                                                      targets, generator)
        dec = self._decode(content, ref_unact, memory, shapes, attn_mask)
        if dn_meta is not None:
            dn, dec = split_denoising(dec, dn_meta["dn_num_split"][0])
        boxes, logits = dec["boxes"], dec["logits"]
        out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        if not self.training:
            out["enc_topk_boxes"], out["enc_topk_logits"] = enc_boxes, enc_logits
        if self.training and self.aux_loss:
            out["aux_outputs"] = [{"pred_logits": lg, "pred_boxes": b}
                                  for lg, b in zip(logits[:-1], boxes[:-1])]
            out["aux_outputs"].append({"pred_logits": enc_logits, "pred_boxes": enc_boxes})
            if dn_meta is not None:
                out["dn_aux_outputs"] = [{"pred_logits": lg, "pred_boxes": b}
                                         for lg, b in zip(dn["logits"], dn["boxes"])]
                out["dn_meta"] = dn_meta
        return out


def selected_queries(model: nn.Module) -> nn.Module | None:
    """The decoder of an RT-DETR / D-FINE ``model`` whose ``num_queries`` top-k proposals
    are its queries; None when it learns its initial queries (``tgt_embed``: their number
    is fixed by the weights)."""
    decoder = getattr(model, "decoder", None)
    if decoder is None or not hasattr(decoder, "num_queries"):
        return None
    return None if getattr(decoder, "tgt_embed", None) is not None else decoder
