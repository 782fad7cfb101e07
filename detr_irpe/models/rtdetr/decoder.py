"""RT-DETR's transformer decoder with IoU-aware query selection (Zhao et al., CVPR 2024,
Sec. 4.3) and contrastive denoising training.

1. The encoder's maps are projected (1x1 conv + BatchNorm per level) and flattened into
   one memory ``(B, L, C)``, ``L = sum_l H_l W_l`` (row-major per level, finest first).
2. Query selection: every memory token is a proposal. Its anchor is a box centred on
   its cell, of size ``0.05 * 2**l`` at level ``l``, in ``inverse_sigmoid`` space; anchors
   with any coordinate outside ``(eps, 1 - eps)`` are invalid (their memory is zeroed and
   their anchor is +inf). ``enc_output`` (Linear + LayerNorm) turns the memory into
   proposal features, scored by ``enc_score_head`` and refined by ``enc_bbox_head``
   (added to the anchor); the ``Q`` proposals of highest best-class score become the
   decoder's queries: their features (detached) are the content, their boxes (detached)
   the initial references.
3. Decoder layers: self-attention (torch MHA; the position of a query is
   ``query_pos_head(reference box)``, added to queries and keys), multi-scale deformable
   cross-attention around the reference box, FFN; post-norm. After layer ``i`` the
   reference becomes ``sigmoid(dec_bbox_head[i](x) + inverse_sigmoid(reference))``, detached
   before the next layer in training (iterative box refinement).

Anchors are computed from the actual feature sizes at every call, also in eval mode
(the published code caches them for a 640 x 640 input there; identical at that size and
failing at any other). They are float32 numbers, as published, whatever the model's dtype.

Key names are the published ``RTDETRTransformer``'s (v1): ``input_proj.{l}.conv`` /
``.norm``, ``decoder.layers.{i}.{self_attn,cross_attn,linear1,linear2,norm1..3}``,
``denoising_class_embed``, ``query_pos_head``, ``enc_output.{0,1}``, ``enc_score_head``,
``enc_bbox_head``, ``dec_score_head.{i}``, ``dec_bbox_head.{i}``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.errors import ConfigError
from detr_irpe.irpe.dropout import Dropout
from detr_irpe.models.mlp import MLP
from detr_irpe.models.rtdetr.deformable import MSDeformableAttention
from detr_irpe.models.rtdetr.denoising import contrastive_denoising
from detr_irpe.models.rtdetr.layers import inverse_sigmoid


def generate_anchors(spatial_shapes: list[tuple[int, int]], grid_size: float = 0.05,
                     eps: float = 1e-2, device: torch.device | None = None
                     ) -> tuple[Tensor, Tensor]:
    """Anchors of every memory token in ``inverse_sigmoid`` space and their validity.

    Returns:
        ``anchors`` ``(1, L, 4)`` float32 (+inf where invalid) and ``valid`` ``(1, L, 1)``
        bool: all four cxcywh coordinates inside ``(eps, 1 - eps)``.
    """
    boxes = []
    for lvl, (height, width) in enumerate(spatial_shapes):
        ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float32),
                                torch.arange(width, dtype=torch.float32), indexing="ij")
        centre = (torch.stack([xs, ys], -1) + 0.5) / torch.tensor([width, height],
                                                                 dtype=torch.float32)
        size = torch.full_like(centre, grid_size * 2.0**lvl)
        boxes.append(torch.cat([centre, size], -1).reshape(1, height * width, 4))
    anchors = torch.cat(boxes, 1).to(device)
    valid = ((anchors > eps) & (anchors < 1 - eps)).all(-1, keepdim=True)
    anchors = torch.log(anchors / (1 - anchors))
    return torch.where(valid, anchors, torch.inf), valid


def decoder_memory(input_proj: nn.ModuleList, feats: list[Tensor], num_levels: int
                   ) -> tuple[Tensor, list[tuple[int, int]]]:
    """The decoder's memory ``(B, sum H_l W_l, C)`` and the level shapes: each encoder map
    through its projection, and ``num_levels - len(feats)`` extra levels, the first from
    the last map, each next from the level before (the projections do the striding)."""
    maps = [proj(f) for proj, f in zip(input_proj, feats)]
    for lvl in range(len(feats), num_levels):
        source = feats[-1] if lvl == len(feats) else maps[-1]
        maps.append(input_proj[lvl](source))
    shapes = [(m.shape[2], m.shape[3]) for m in maps]
    return torch.cat([m.flatten(2).transpose(1, 2) for m in maps], 1), shapes


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
        qk = x + query_pos
        x = self.norm1(x + self.dropout1(
            self.self_attn(qk, qk, x, attn_mask=attn_mask, need_weights=False)[0]))
        x = self.norm2(x + self.dropout2(
            self.cross_attn(x + query_pos, reference, memory, spatial_shapes)))
        ffn = self.linear2(self.dropout3(F.relu(self.linear1(x))))
        # the clamp keeps fp16 finite (65504: its largest value), as published
        return self.norm3((x + self.dropout4(ffn)).clamp(-65504, 65504))


class LayerStack(nn.Module):
    """The decoder layers (key ``layers.{i}``)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class RTDETRDecoder(nn.Module):
    """Query selection + decoder + heads (module docstring).

    Args:
        num_classes: C (sigmoid logits, no "no object" column).
        hidden_dim, nhead, dim_feedforward, dropout: of the decoder layers (256, 8, 1024, 0).
        num_queries: Q, the selected proposals (300).
        feat_channels: channels of the encoder maps (256 each).
        num_levels: memory levels (3); extra levels beyond the encoder's maps come from
            3x3 / 2 convs.
        num_points: sampling points per head and level (4).
        num_layers: decoder layers (R50: 6, R34: 4, R18: 3).
        num_denoising, label_noise, box_noise: contrastive denoising in training
            (100, 0.5, 1.0; ``num_denoising=0``: off, and no ``denoising_class_embed``).
        learnt_init_query: learned content queries (``tgt_embed``) instead of the selected
            proposals' features.
        eval_idx: the layer whose output is the eval-time prediction (-1: the last).
        eps: anchor validity margin (0.01).
        aux_loss: training outputs of every layer and of the proposals.
    """

    def __init__(
        self,
        num_classes: int = 80,
        hidden_dim: int = 256,
        num_queries: int = 300,
        feat_channels: tuple[int, ...] = (256, 256, 256),
        num_levels: int = 3,
        num_points: int = 4,
        nhead: int = 8,
        num_layers: int = 6,
        dim_feedforward: int = 1024,
        dropout: float = 0.0,
        num_denoising: int = 100,
        label_noise: float = 0.5,
        box_noise: float = 1.0,
        learnt_init_query: bool = False,
        eval_idx: int = -1,
        eps: float = 1e-2,
        aux_loss: bool = True,
    ) -> None:
        super().__init__()
        if len(feat_channels) > num_levels:
            raise ValueError(f"{len(feat_channels)} encoder maps for {num_levels} levels")
        if not -num_layers <= eval_idx < num_layers:
            raise ValueError(f"eval_idx {eval_idx} outside the {num_layers} decoder layers")
        self.num_classes = num_classes
        self.hidden_dim = hidden_dim
        self.num_queries = num_queries
        self.num_levels = num_levels
        self.num_layers = num_layers
        self.eval_idx = eval_idx % num_layers
        self.eps = eps
        self.aux_loss = aux_loss
        self.num_denoising = num_denoising
        self.label_noise = label_noise
        self.box_noise = box_noise
        self.learnt_init_query = learnt_init_query

        projections = []
        channels = list(feat_channels)
        for lvl in range(num_levels):
            extra = lvl >= len(feat_channels)
            c_in = channels[-1] if lvl == len(feat_channels) else (hidden_dim if extra
                                                                    else channels[lvl])
            conv = (nn.Conv2d(c_in, hidden_dim, 3, 2, padding=1, bias=False) if extra
                    else nn.Conv2d(c_in, hidden_dim, 1, bias=False))
            projections.append(nn.Sequential(OrderedDict(
                [("conv", conv), ("norm", nn.BatchNorm2d(hidden_dim))])))
        self.input_proj = nn.ModuleList(projections)
        self.num_input_maps = len(feat_channels)

        self.decoder = LayerStack([
            DecoderLayer(hidden_dim, nhead, dim_feedforward, dropout, num_levels, num_points)
            for _ in range(num_layers)
        ])
        if num_denoising > 0:
            self.denoising_class_embed = nn.Embedding(num_classes + 1, hidden_dim,
                                                      padding_idx=num_classes)
        if learnt_init_query:
            self.tgt_embed = nn.Embedding(num_queries, hidden_dim)
        self.query_pos_head = MLP(4, 2 * hidden_dim, hidden_dim, 2)
        self.enc_output = nn.Sequential(nn.Linear(hidden_dim, hidden_dim),
                                        nn.LayerNorm(hidden_dim))
        self.enc_score_head = nn.Linear(hidden_dim, num_classes)
        self.enc_bbox_head = MLP(hidden_dim, hidden_dim, 4, 3)
        self.dec_score_head = nn.ModuleList(nn.Linear(hidden_dim, num_classes)
                                            for _ in range(num_layers))
        self.dec_bbox_head = nn.ModuleList(MLP(hidden_dim, hidden_dim, 4, 3)
                                           for _ in range(num_layers))
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # class heads start at a prior probability of 0.01 (focal-loss practice), box
        # heads at zero (the first boxes are the anchors / references)
        prior = -math.log((1 - 0.01) / 0.01)
        for score, box in [(self.enc_score_head, self.enc_bbox_head),
                           *zip(self.dec_score_head, self.dec_bbox_head)]:
            nn.init.constant_(score.bias, prior)
            nn.init.zeros_(box.layers[-1].weight)
            nn.init.zeros_(box.layers[-1].bias)
        nn.init.xavier_uniform_(self.enc_output[0].weight)
        nn.init.xavier_uniform_(self.query_pos_head.layers[0].weight)
        nn.init.xavier_uniform_(self.query_pos_head.layers[1].weight)
        if self.learnt_init_query:
            nn.init.xavier_uniform_(self.tgt_embed.weight)
        if self.num_denoising > 0:
            with torch.no_grad():
                nn.init.normal_(self.denoising_class_embed.weight[:-1])

    def _memory(self, feats: list[Tensor]) -> tuple[Tensor, list[tuple[int, int]]]:
        return decoder_memory(self.input_proj, feats, self.num_levels)

    def _select_queries(self, memory: Tensor, shapes: list[tuple[int, int]]
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> content ``(B, Q, C)`` and references ``(B, Q, 4)`` unactivated (both
        detached), and the proposals' boxes ``(B, Q, 4)`` and logits ``(B, Q, C)``."""
        anchors, valid = generate_anchors(shapes, eps=self.eps, device=memory.device)
        features = self.enc_output(valid.to(memory.dtype) * memory)
        logits = self.enc_score_head(features)
        boxes_unact = self.enc_bbox_head(features) + anchors
        if memory.shape[1] < self.num_queries and not torch.compiler.is_exporting():
            sides = " + ".join(f"{h}x{w}" for h, w in shapes)
            raise ConfigError(
                f"model.num_queries={self.num_queries} is more than the {memory.shape[1]} "
                f"proposals of this input's feature maps ({sides}): give a larger image or "
                "fewer queries")
        top = logits.max(-1).values.topk(self.num_queries, dim=1).indices  # (B, Q)

        def pick(x: Tensor) -> Tensor:
            return x.gather(1, top[..., None].expand(-1, -1, x.shape[-1]))

        ref_unact = pick(boxes_unact)
        if self.learnt_init_query:
            content = self.tgt_embed.weight[None].expand(memory.shape[0], -1, -1)
        else:
            content = pick(features).detach()
        return content, ref_unact.detach(), ref_unact.sigmoid(), pick(logits)

    def _decode(self, x: Tensor, ref_unact: Tensor, memory: Tensor,
                shapes: list[tuple[int, int]], attn_mask: Tensor | None
                ) -> tuple[list[Tensor], list[Tensor]]:
        """-> per decoded layer, boxes ``(B, P + Q, 4)`` and logits (eval: only ``eval_idx``)."""
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
        return boxes, logits

    def forward(self, feats: list[Tensor], targets: list[dict] | None = None,
                generator: torch.Generator | None = None) -> dict:
        """
        Args:
            feats: the encoder's maps ``(B, C_l, H_l, W_l)``, finest first.
            targets: in training with denoising, B dicts with ``labels`` (class indices)
                and ``boxes`` (cxcywh normalised).
            generator: the denoising noise's random source (None: torch's global RNG).

        Returns:
            ``pred_logits`` ``(B, Q, C)``, ``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1]; in
            training (``aux_loss``) also ``aux_outputs`` (every layer but the last, then the
            selected proposals: ``num_layers`` dicts), and with denoising
            ``dn_aux_outputs`` (every layer's denoising queries) and ``dn_meta``
            (:func:`~.denoising.contrastive_denoising`); in eval mode also the selected
            proposals the decoder started from (the ``selected-queries`` figure):
            ``enc_topk_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1] and ``enc_topk_logits``
            ``(B, Q, C)``, in the order of the queries.
        """
        memory, shapes = self._memory(feats)
        dn_meta = None
        attn_mask = None
        content, ref_unact, enc_boxes, enc_logits = self._select_queries(memory, shapes)
        if self.training and self.num_denoising > 0:
            if targets is None:
                raise ValueError("training with denoising needs the targets: model(images, "
                                 "targets)")
            dn_content, dn_ref, attn_mask, dn_meta = contrastive_denoising(
                targets, self.num_classes, self.num_queries, self.denoising_class_embed,
                self.num_denoising, self.label_noise, self.box_noise, generator)
            content = torch.cat([dn_content, content], 1)
            ref_unact = torch.cat([dn_ref, ref_unact], 1)
        boxes, logits = self._decode(content, ref_unact, memory, shapes, attn_mask)
        if dn_meta is not None:
            num_dn = dn_meta["dn_num_split"][0]
            dn_boxes = [b[:, :num_dn] for b in boxes]
            dn_logits = [lg[:, :num_dn] for lg in logits]
            boxes = [b[:, num_dn:] for b in boxes]
            logits = [lg[:, num_dn:] for lg in logits]
        out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        if not self.training:
            out["enc_topk_boxes"], out["enc_topk_logits"] = enc_boxes, enc_logits
        if self.training and self.aux_loss:
            out["aux_outputs"] = [{"pred_logits": lg, "pred_boxes": b}
                                  for lg, b in zip(logits[:-1], boxes[:-1])]
            out["aux_outputs"].append({"pred_logits": enc_logits, "pred_boxes": enc_boxes})
            if dn_meta is not None:
                out["dn_aux_outputs"] = [{"pred_logits": lg, "pred_boxes": b}
                                         for lg, b in zip(dn_logits, dn_boxes)]
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
