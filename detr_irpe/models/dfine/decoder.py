"""D-FINE's decoder: RT-DETR's query selection and denoising with Fine-grained
Distribution Refinement (Peng et al., ICLR 2025, section 3).

1. Query selection as RT-DETR's, the hybrid families' shared one
   (:mod:`detr_irpe.models.hybrid.decoder`): the memory's tokens are proposals around
   anchors computed for the input's feature sizes; the ``Q`` of highest class score become
   the queries (content: their features, detached; references: their boxes, detached).
   With denoising, RT-DETR's contrastive queries come first
   (:func:`~detr_irpe.models.hybrid.denoising.contrastive_denoising`; negative
   sizes of a noisy box made positive, as D-FINE does).
2. Decoder layer (:class:`DecoderLayer`): self-attention (position ``query_pos_head`` of
   the current boxes, clamped to [-10, 10]), deformable cross-attention without value /
   output projection and with a point count per level
   (:class:`~.deformable.DFINEDeformableAttention`), then a :class:`Gate` (instead of the
   residual + ``norm2``), then the FFN, post-norm.
3. Boxes: after layer 0, ``pre_bbox_head`` refines the selected box once (``sigmoid(head
   + inverse_sigmoid(box))``); that box is the fixed reference of every layer's
   distributions. Layer ``i``'s ``dec_bbox_head[i]`` gives ``4 x (reg_max + 1)`` bin
   logits from its output plus the previous layer's detached output, added to the previous
   layer's logits (with their gradient); the box is
   :func:`~.distribution.distance_to_box` of the reference and
   :func:`~.distribution.integral` of the logits (:mod:`.distribution`). The next layer's
   reference for attention is this box, detached.
4. Scores: ``dec_score_head[i]`` plus the localisation quality estimate (:class:`LQE`)
   of the layer's distributions.

At evaluation the decoder stops at ``eval_idx``. With ``record_layers`` set (an attribute,
off by default: the outputs are then exactly the usual ones), the eval-mode outputs also
carry every decoded layer's distribution logits and the fixed reference boxes, for the
``distributions`` figure (:mod:`detr_irpe.visualization.distributions`).

``activation`` is the FFN's and every MLP's (``query_pos_head``, ``enc_bbox_head``,
``pre_bbox_head``, ``dec_bbox_head``, LQE): ReLU in D-FINE, SiLU in DEIM.

Key names are the published ``DFINETransformer``'s: ``input_proj.{l}.{conv,norm}`` (only
where a map's width differs from the decoder's), ``decoder.layers.{i}.{self_attn,
norm1, cross_attn, gateway.{gate,norm}, linear1, linear2, norm3}``,
``decoder.lqe_layers.{i}.reg_conf.layers.{0,1}``, ``up`` / ``reg_scale`` (also as
``decoder.up`` / ``decoder.reg_scale``: one parameter each, under two names, as
published), ``denoising_class_embed``, ``query_pos_head``, ``enc_output.{proj,norm}``,
``enc_score_head``, ``enc_bbox_head``, ``dec_score_head.{i}``, ``pre_bbox_head``,
``dec_bbox_head.{i}``. The published model also saves the anchors of its
``eval_spatial_size`` (``anchors``, ``valid_mask``); they are computed here for every
input and those keys are dropped when a published file is read
(:mod:`.checkpoint`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.attention.dropout import Dropout
from detr_irpe.models.box_ops import inverse_sigmoid
from detr_irpe.models.dfine.deformable import DFINEDeformableAttention
from detr_irpe.models.dfine.distribution import distance_to_box, integral, weighting_function
from detr_irpe.models.hybrid.decoder import (
    HybridDecoder,
    feed_forward,
    input_projections,
    self_attention,
    split_denoising,
)
from detr_irpe.models.hybrid.settings import DecoderSettings
from detr_irpe.models.mlp import MLP, MLP_ACTIVATIONS

# the top probabilities of each edge's distribution the LQE reads (and their mean)
LQE_TOP_K = 4
LQE_HIDDEN = 64


class Gate(nn.Module):
    """``norm(g1 * x1 + g2 * x2)`` with ``(g1, g2) = sigmoid(gate([x1, x2]))``, per channel
    (keys ``gate``, ``norm``). Starts at ``g1 = g2 = 0.5`` (zero weights and biases)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * d_model, 2 * d_model)
        self.norm = nn.LayerNorm(d_model)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        """``x1``, ``x2`` ``(B, Q, C)`` -> ``(B, Q, C)``."""
        g1, g2 = torch.sigmoid(self.gate(torch.cat([x1, x2], -1))).chunk(2, -1)
        return self.norm(g1 * x1 + g2 * x2)


class LQE(nn.Module):
    """Localisation quality estimator: per query, the top ``k`` probabilities of each edge's
    distribution and their mean (``4 (k + 1)`` numbers) -> an MLP -> a scalar added to
    every class logit (key ``reg_conf``). Starts at 0 (last layer zero)."""

    def __init__(self, reg_max: int, k: int = LQE_TOP_K, hidden: int = LQE_HIDDEN,
                 activation: str = "relu") -> None:
        super().__init__()
        self.k = k
        self.reg_max = reg_max
        self.reg_conf = MLP(4 * (k + 1), hidden, 1, 2, activation)
        nn.init.zeros_(self.reg_conf.layers[-1].weight)
        nn.init.zeros_(self.reg_conf.layers[-1].bias)

    def forward(self, scores: Tensor, corners: Tensor) -> Tensor:
        """``scores`` ``(B, Q, C)``, ``corners`` ``(B, Q, 4 (reg_max + 1))`` -> ``(B, Q, C)``."""
        batch, queries, _ = corners.shape
        prob = F.softmax(corners.reshape(batch, queries, 4, self.reg_max + 1), dim=-1)
        top = prob.topk(self.k, dim=-1).values
        stat = torch.cat([top, top.mean(dim=-1, keepdim=True)], dim=-1)
        return scores + self.reg_conf(stat.reshape(batch, queries, -1))


class DecoderLayer(nn.Module):
    """Self-attention (post-norm), deformable cross-attention + :class:`Gate`, FFN
    (post-norm)."""

    def __init__(self, d_model: int = 256, nhead: int = 8, dim_feedforward: int = 1024,
                 dropout: float = 0.0, num_points: Sequence[int] = (3, 6, 3),
                 activation: str = "relu") -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(d_model)
        self.cross_attn = DFINEDeformableAttention(d_model, nhead, num_points)
        self.gateway = Gate(d_model)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.dropout4 = Dropout(dropout)
        self._act = MLP_ACTIVATIONS[activation]
        nn.init.xavier_uniform_(self.linear1.weight)
        nn.init.xavier_uniform_(self.linear2.weight)

    def forward(self, x: Tensor, reference: Tensor, memory: Tensor,
                spatial_shapes: list[tuple[int, int]], query_pos: Tensor,
                attn_mask: Tensor | None = None) -> Tensor:
        """``x``, ``query_pos`` ``(B, Q, C)``; ``reference`` ``(B, Q, 1, 4)`` cxcywh;
        ``memory`` ``(B, L, C)``; ``attn_mask`` ``(Q, Q)`` bool, True = blocked."""
        x = self_attention(self, x, query_pos, attn_mask)
        x = self.gateway(x, self.dropout2(
            self.cross_attn(x + query_pos, reference, memory, spatial_shapes)))
        return feed_forward(self, x, self._act)


class LayerStack(nn.Module):
    """The decoder layers and their LQEs (keys ``layers.{i}``, ``lqe_layers.{i}``), and the
    two FDR constants under the published second names ``up`` and ``reg_scale``."""

    def __init__(self, layers: list[DecoderLayer], lqe_layers: list[LQE], up: nn.Parameter,
                 reg_scale: nn.Parameter) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.lqe_layers = nn.ModuleList(lqe_layers)
        self.up = up
        self.reg_scale = reg_scale


@dataclass(frozen=True)
class DFINEDecoderSettings(DecoderSettings):
    """D-FINE's decoder settings: the shared ones (points: one count per level) and FDR's.

    Attributes:
        reg_max: the index of the last bin of each edge (32).
        reg_scale: c of the weighting function (4; X: 8).
        up: u of the weighting function (0.5).
        activation: of the FFNs and MLP heads (``relu``: D-FINE; ``silu``: DEIM).
    """

    num_points: tuple[int, ...] = (3, 6, 3)
    reg_max: int = 32
    reg_scale: float = 4.0
    up: float = 0.5
    activation: str = "relu"

    def __post_init__(self) -> None:
        if isinstance(self.num_points, int):
            raise ValueError(f"num_points {self.num_points} must give the points of each of "
                             f"the {self.num_levels} levels")
        super().__post_init__()
        if self.activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(MLP_ACTIVATIONS)}, "
                             f"got {self.activation!r}")

    def mlp_activation(self) -> str:
        return self.activation


class DFINEDecoder(HybridDecoder):
    """Query selection + decoder + heads with FDR (module docstring), built from
    :class:`DFINEDecoderSettings`. A 1x1 conv + BatchNorm projects an encoder map only where
    its width is not ``hidden_dim`` (D-FINE-X's 384)."""

    DENOISING_ABS_SIZES = True
    DENOISING_IN_QUERY_DTYPE = True

    def __init__(self, settings: DFINEDecoderSettings | None = None) -> None:
        super().__init__(settings if settings is not None else DFINEDecoderSettings())
        self.reg_max = self.settings.reg_max
        # opt-in, eval mode only: also return every decoded layer's corners (forward)
        self.record_layers = False

    def build_input_projections(self, s: DFINEDecoderSettings) -> nn.ModuleList:
        return input_projections(s, identity_when_equal=True)

    def build_layers(self, s: DFINEDecoderSettings) -> None:
        # FDR's constants: parameters without gradient (published state-dict entries)
        self.up = nn.Parameter(torch.tensor([float(s.up)]), requires_grad=False)
        self.reg_scale = nn.Parameter(torch.tensor([float(s.reg_scale)]), requires_grad=False)
        self.decoder = LayerStack(
            [DecoderLayer(s.hidden_dim, s.nhead, s.dim_feedforward, s.dropout, s.num_points,
                          s.activation) for _ in range(s.num_layers)],
            [LQE(s.reg_max, activation=s.activation) for _ in range(s.num_layers)],
            self.up, self.reg_scale)

    def build_enc_output(self, hidden: int) -> nn.Sequential:
        return nn.Sequential(OrderedDict([
            ("proj", nn.Linear(hidden, hidden)), ("norm", nn.LayerNorm(hidden))]))

    def build_box_heads(self, s: DFINEDecoderSettings) -> None:
        self.pre_bbox_head = self.mlp(s.hidden_dim, s.hidden_dim, 4, 3)
        self.dec_bbox_head = nn.ModuleList(self.mlp(s.hidden_dim, s.hidden_dim,
                                                    4 * (s.reg_max + 1), 3)
                                           for _ in range(s.num_layers))

    def box_heads(self) -> list[MLP]:
        return [self.enc_bbox_head, self.pre_bbox_head, *self.dec_bbox_head]

    def reset_family_parameters(self) -> None:
        for proj in self.input_proj[:self.num_input_maps]:
            if isinstance(proj, nn.Sequential):
                nn.init.xavier_uniform_(proj.conv.weight)

    # ---------------------------------------------------------------- the steps
    def _select_queries(self, memory: Tensor, shapes: list[tuple[int, int]]
                        ) -> tuple[Tensor, Tensor, Tensor]:
        """-> content ``(B, Q, C)`` (detached), the selected boxes ``(B, Q, 4)``
        unactivated (with their gradient), and their class logits ``(B, Q, C)``."""
        features, logits, anchors, top = self._proposals(memory, shapes)
        chosen = self.pick(features, top)
        boxes_unact = self.enc_bbox_head(chosen) + self.pick(anchors, top)
        return chosen.detach(), boxes_unact, self.pick(logits, top)

    def _decode(self, x: Tensor, ref_unact: Tensor, memory: Tensor,
                shapes: list[tuple[int, int]], attn_mask: Tensor | None) -> dict[str, list]:
        """-> per decoded layer (eval: only ``eval_idx``): ``boxes`` ``(B, P + Q, 4)``,
        ``logits``, ``corners`` ``(B, P + Q, 4 (reg_max + 1))``, ``refs`` (the fixed
        reference boxes); and ``pre`` = ``(boxes, logits)`` of ``pre_bbox_head``; with
        ``record_layers`` in eval mode ``layer_corners``, the corners of every layer up to
        ``eval_idx``."""
        weights = weighting_function(self.reg_max, self.up, self.reg_scale)
        out: dict[str, list] = {"boxes": [], "logits": [], "corners": [], "refs": [],
                                "layer_corners": []}
        record = self.record_layers and not self.training
        reference = ref_unact.sigmoid()
        previous_x: Tensor | float = 0.0
        previous_corners: Tensor | float = 0.0
        initial = query_pos = None
        for i, layer in enumerate(self.decoder.layers):
            query_pos = self.layer_query_pos(reference, ref_unact, query_pos)
            x = layer(x, reference[:, :, None], memory, shapes, query_pos, attn_mask)
            if i == 0:
                pre_boxes = (self.pre_bbox_head(x) + inverse_sigmoid(reference)).sigmoid()
                out["pre"] = [pre_boxes, self.dec_score_head[0](x)]
                initial = pre_boxes.detach()
            corners = self.dec_bbox_head[i](x + previous_x) + previous_corners
            boxes = distance_to_box(initial, integral(corners, weights), self.reg_scale)
            if record:
                out["layer_corners"].append(corners)
            if self.training or i == self.eval_idx:
                out["logits"].append(self.decoder.lqe_layers[i](self.dec_score_head[i](x),
                                                                corners))
                out["boxes"].append(boxes)
                out["corners"].append(corners)
                out["refs"].append(initial)
                if not self.training:
                    break
            previous_corners = corners
            reference = boxes.detach()
            previous_x = x.detach()
        return out

    def layer_query_pos(self, reference: Tensor, ref_unact: Tensor,
                        previous: Tensor | None) -> Tensor:
        """The query position embedding of the next layer, from its reference boxes
        ``reference`` (D-FINE: recomputed per layer, clamped to [-10, 10]); ``ref_unact`` are
        the initial references unactivated, ``previous`` the last layer's embedding (None
        before the first)."""
        return self.query_pos_head(reference).clamp(-10, 10)

    def bin_values(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values ``W(n)`` of the ``reg_max + 1`` bins of every edge distribution (on
        the CPU, in ``dtype``): what a distribution's integral weighs its bins with."""
        return weighting_function(self.reg_max, self.up.detach().cpu().to(dtype),
                                  self.reg_scale.detach().cpu().to(dtype))

    def decode(self, memory: Tensor, shapes: list[tuple[int, int]],
               targets: list[dict] | None, generator: torch.Generator | None) -> dict:
        """The outputs (:meth:`~detr_irpe.models.hybrid.decoder.HybridDecoder.forward`);
        with ``record_layers`` in eval mode also
        ``layer_corners`` ``(eval_idx + 1, B, Q, 4 (reg_max + 1))`` (the distribution
        logits of every decoded layer, the last one that of ``pred_boxes``) and
        ``ref_points`` ``(B, Q, 4)`` (their fixed reference boxes, cxcywh). In training
        (the published keys) also
        ``pred_corners`` ``(B, Q, 4 (reg_max + 1))``, ``ref_points`` ``(B, Q, 4)``,
        ``up``, ``reg_scale``, and with ``aux_loss``: ``aux_outputs`` (every layer but
        the last: ``pred_logits``, ``pred_boxes``, ``pred_corners``, ``ref_points``,
        ``teacher_corners`` / ``teacher_logits`` = the last layer's),
        ``enc_aux_outputs`` (one dict: the selected proposals), ``pre_outputs``
        (``pre_bbox_head``'s boxes and layer 0's scores), ``enc_meta``
        (``class_agnostic``: False); with denoising ``dn_outputs`` (every layer, the
        teacher the last), ``dn_pre_outputs`` and ``dn_meta``
        (:func:`~detr_irpe.models.hybrid.denoising.contrastive_denoising`).
        """
        content, ref_unact, enc_logits = self._select_queries(memory, shapes)
        enc_boxes = ref_unact.sigmoid()
        content, ref_unact, attn_mask, dn_meta = self._with_denoising(
            content, ref_unact.detach(), targets, generator)
        dec = self._decode(content, ref_unact, memory, shapes, attn_mask)
        if dn_meta is not None:
            dn, dec = split_denoising(dec, dn_meta["dn_num_split"][0])
            dn_pre = {"pred_logits": dn["pre"][1], "pred_boxes": dn["pre"][0]}
        pre_boxes, pre_logits = dec["pre"]
        out = {"pred_logits": dec["logits"][-1], "pred_boxes": dec["boxes"][-1]}
        if not self.training:
            out["enc_topk_boxes"], out["enc_topk_logits"] = enc_boxes, enc_logits
            if dec["layer_corners"]:
                out["layer_corners"] = torch.stack(dec["layer_corners"])
                out["ref_points"] = dec["refs"][-1]
            return out
        out.update(pred_corners=dec["corners"][-1], ref_points=dec["refs"][-1], up=self.up,
                   reg_scale=self.reg_scale)
        if self.aux_loss:
            out["aux_outputs"] = _layer_outputs(dec, last=False)
            out["enc_aux_outputs"] = [{"pred_logits": enc_logits, "pred_boxes": enc_boxes}]
            out["pre_outputs"] = {"pred_logits": pre_logits, "pred_boxes": pre_boxes}
            out["enc_meta"] = {"class_agnostic": False}
            if dn_meta is not None:
                out["dn_outputs"] = _layer_outputs(dn, last=True)
                out["dn_pre_outputs"] = dn_pre
                out["dn_meta"] = dn_meta
        return out


def _layer_outputs(dec: dict[str, list], last: bool) -> list[dict]:
    """The per-layer output dicts (every layer, or all but the last), each with the last
    layer's corners and logits as its teacher."""
    count = len(dec["logits"]) - (0 if last else 1)
    return [{"pred_logits": dec["logits"][i], "pred_boxes": dec["boxes"][i],
             "pred_corners": dec["corners"][i], "ref_points": dec["refs"][i],
             "teacher_corners": dec["corners"][-1], "teacher_logits": dec["logits"][-1]}
            for i in range(count)]
