"""D-FINE's decoder: RT-DETR's query selection and denoising with Fine-grained
Distribution Refinement (Peng et al., ICLR 2025, section 3).

1. Query selection as RT-DETR's (:mod:`detr_irpe.models.rtdetr.decoder`): the memory's
   tokens are proposals around anchors computed for the input's feature sizes; the ``Q``
   of highest class score become the queries (content: their features, detached;
   references: their boxes, detached). With denoising, RT-DETR's contrastive queries come
   first (:func:`~detr_irpe.models.rtdetr.denoising.contrastive_denoising`; negative
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

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.irpe.dropout import Dropout
from detr_irpe.models.dfine.deformable import DFINEDeformableAttention
from detr_irpe.models.dfine.distribution import distance_to_box, integral, weighting_function
from detr_irpe.models.mlp import MLP, MLP_ACTIVATIONS
from detr_irpe.models.rtdetr.decoder import decoder_memory, generate_anchors
from detr_irpe.models.rtdetr.denoising import contrastive_denoising
from detr_irpe.models.rtdetr.layers import inverse_sigmoid

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
        qk = x + query_pos
        x = self.norm1(x + self.dropout1(
            self.self_attn(qk, qk, x, attn_mask=attn_mask, need_weights=False)[0]))
        x = self.gateway(x, self.dropout2(
            self.cross_attn(x + query_pos, reference, memory, spatial_shapes)))
        ffn = self.linear2(self.dropout3(self._act(self.linear1(x))))
        # the clamp keeps fp16 finite (65504: its largest value), as published
        return self.norm3((x + self.dropout4(ffn)).clamp(-65504, 65504))


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


class DFINEDecoder(nn.Module):
    """Query selection + decoder + heads with FDR (module docstring).

    Args:
        num_classes: C (sigmoid logits).
        hidden_dim, nhead, dim_feedforward, dropout: of the decoder layers.
        num_queries: Q.
        feat_channels: channels of the encoder's maps (a 1x1 conv + BatchNorm projects a
            map whose width is not ``hidden_dim``: D-FINE-X's 384).
        num_levels: memory levels (extra levels beyond the encoder's maps come from 3x3 / 2
            conv units).
        num_points: sampling points of each level.
        num_layers: decoder layers.
        num_denoising, label_noise, box_noise: contrastive denoising in training (0: off).
        eval_idx: the layer whose output is the eval-time prediction (-1: the last).
        reg_max: the index of the last bin of each edge (32).
        reg_scale: c of the weighting function (4; X: 8).
        up: u of the weighting function (0.5).
        activation: of the FFNs and MLP heads (``relu``: D-FINE; ``silu``: DEIM).
        eps: anchor validity margin (0.01).
        aux_loss: training outputs of every layer, of ``pre_bbox_head`` and of the proposals.
    """

    def __init__(
        self,
        num_classes: int = 80,
        hidden_dim: int = 256,
        num_queries: int = 300,
        feat_channels: Sequence[int] = (256, 256, 256),
        num_levels: int = 3,
        num_points: Sequence[int] = (3, 6, 3),
        nhead: int = 8,
        num_layers: int = 6,
        dim_feedforward: int = 1024,
        dropout: float = 0.0,
        num_denoising: int = 100,
        label_noise: float = 0.5,
        box_noise: float = 1.0,
        eval_idx: int = -1,
        reg_max: int = 32,
        reg_scale: float = 4.0,
        up: float = 0.5,
        activation: str = "relu",
        eps: float = 1e-2,
        aux_loss: bool = True,
    ) -> None:
        super().__init__()
        if len(feat_channels) > num_levels:
            raise ValueError(f"{len(feat_channels)} encoder maps for {num_levels} levels")
        if len(num_points) != num_levels:
            raise ValueError(f"num_points {tuple(num_points)} must give the points of each of "
                             f"the {num_levels} levels")
        if not -num_layers <= eval_idx < num_layers:
            raise ValueError(f"eval_idx {eval_idx} outside the {num_layers} decoder layers")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(MLP_ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.num_classes = num_classes
        self.hidden_dim = hidden_dim
        self.num_queries = num_queries
        self.num_levels = num_levels
        self.num_layers = num_layers
        self.eval_idx = eval_idx % num_layers
        self.reg_max = reg_max
        self.eps = eps
        self.aux_loss = aux_loss
        self.num_denoising = num_denoising
        self.label_noise = label_noise
        self.box_noise = box_noise
        self.activation = activation
        # opt-in, eval mode only: also return every decoded layer's corners (forward)
        self.record_layers = False

        self.input_proj = nn.ModuleList()
        for lvl in range(num_levels):
            if lvl < len(feat_channels):
                c_in, kernel, stride = feat_channels[lvl], 1, 1
            else:
                c_in = feat_channels[-1] if lvl == len(feat_channels) else hidden_dim
                kernel, stride = 3, 2
            if c_in == hidden_dim and kernel == 1:
                self.input_proj.append(nn.Identity())
                continue
            self.input_proj.append(nn.Sequential(OrderedDict([
                ("conv", nn.Conv2d(c_in, hidden_dim, kernel, stride, padding=kernel // 2,
                                   bias=False)),
                ("norm", nn.BatchNorm2d(hidden_dim))])))
        self.num_input_maps = len(feat_channels)

        # FDR's constants: parameters without gradient (published state-dict entries)
        self.up = nn.Parameter(torch.tensor([float(up)]), requires_grad=False)
        self.reg_scale = nn.Parameter(torch.tensor([float(reg_scale)]), requires_grad=False)
        self.decoder = LayerStack(
            [DecoderLayer(hidden_dim, nhead, dim_feedforward, dropout, num_points, activation)
             for _ in range(num_layers)],
            [LQE(reg_max, activation=activation) for _ in range(num_layers)],
            self.up, self.reg_scale)
        if num_denoising > 0:
            self.denoising_class_embed = nn.Embedding(num_classes + 1, hidden_dim,
                                                      padding_idx=num_classes)
        self.query_pos_head = MLP(4, 2 * hidden_dim, hidden_dim, 2, activation)
        self.enc_output = nn.Sequential(OrderedDict([
            ("proj", nn.Linear(hidden_dim, hidden_dim)), ("norm", nn.LayerNorm(hidden_dim))]))
        self.enc_score_head = nn.Linear(hidden_dim, num_classes)
        self.enc_bbox_head = MLP(hidden_dim, hidden_dim, 4, 3, activation)
        self.dec_score_head = nn.ModuleList(nn.Linear(hidden_dim, num_classes)
                                            for _ in range(num_layers))
        self.pre_bbox_head = MLP(hidden_dim, hidden_dim, 4, 3, activation)
        self.dec_bbox_head = nn.ModuleList(MLP(hidden_dim, hidden_dim, 4 * (reg_max + 1), 3,
                                               activation) for _ in range(num_layers))
        self._reset_parameters(feat_channels)

    def _reset_parameters(self, feat_channels: Sequence[int]) -> None:
        # class heads start at probability 0.01 (focal-loss practice), box heads at zero
        # (the first boxes are the anchors, then the selected boxes, then the reference)
        prior = -math.log((1 - 0.01) / 0.01)
        for score in [self.enc_score_head, *self.dec_score_head]:
            nn.init.constant_(score.bias, prior)
        for box in [self.enc_bbox_head, self.pre_bbox_head, *self.dec_bbox_head]:
            nn.init.zeros_(box.layers[-1].weight)
            nn.init.zeros_(box.layers[-1].bias)
        nn.init.xavier_uniform_(self.enc_output.proj.weight)
        nn.init.xavier_uniform_(self.query_pos_head.layers[0].weight)
        nn.init.xavier_uniform_(self.query_pos_head.layers[1].weight)
        for proj in self.input_proj[:len(feat_channels)]:
            if isinstance(proj, nn.Sequential):
                nn.init.xavier_uniform_(proj.conv.weight)
        if self.num_denoising > 0:
            with torch.no_grad():
                nn.init.normal_(self.denoising_class_embed.weight[:-1])

    # ---------------------------------------------------------------- the steps
    def _memory(self, feats: list[Tensor]) -> tuple[Tensor, list[tuple[int, int]]]:
        return decoder_memory(self.input_proj, feats, self.num_levels)

    def _select_queries(self, memory: Tensor, shapes: list[tuple[int, int]]
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> content ``(B, Q, C)`` (detached), the selected boxes ``(B, Q, 4)``
        unactivated (with their gradient), and their class logits ``(B, Q, C)``."""
        anchors, valid = generate_anchors(shapes, eps=self.eps, device=memory.device)
        features = self.enc_output(valid.to(memory.dtype) * memory)
        logits = self.enc_score_head(features)
        if memory.shape[1] < self.num_queries and not torch.compiler.is_exporting():
            sides = " + ".join(f"{h}x{w}" for h, w in shapes)
            raise ValueError(
                f"model.num_queries={self.num_queries} is more than the {memory.shape[1]} "
                f"proposals of this input's feature maps ({sides}): give a larger image or "
                "fewer queries")
        top = logits.max(-1).values.topk(self.num_queries, dim=1).indices  # (B, Q)

        def pick(x: Tensor) -> Tensor:
            x = x.expand(memory.shape[0], -1, -1)
            return x.gather(1, top[..., None].expand(-1, -1, x.shape[-1]))

        chosen = pick(features)
        boxes_unact = self.enc_bbox_head(chosen) + pick(anchors)
        return chosen.detach(), boxes_unact, pick(logits)

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
        initial = None
        for i, layer in enumerate(self.decoder.layers):
            query_pos = self.query_pos_head(reference).clamp(-10, 10)
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

    def bin_values(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values ``W(n)`` of the ``reg_max + 1`` bins of every edge distribution (on
        the CPU, in ``dtype``): what a distribution's integral weighs its bins with."""
        return weighting_function(self.reg_max, self.up.detach().cpu().to(dtype),
                                  self.reg_scale.detach().cpu().to(dtype))

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
            eval mode also ``enc_topk_boxes`` / ``enc_topk_logits`` (the selected
            proposals, in query order); with ``record_layers`` in eval mode also
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
            (:func:`~detr_irpe.models.rtdetr.denoising.contrastive_denoising`).
        """
        memory, shapes = self._memory(feats)
        content, ref_unact, enc_logits = self._select_queries(memory, shapes)
        enc_boxes = ref_unact.sigmoid()
        ref_unact = ref_unact.detach()
        dn_meta = None
        attn_mask = None
        if self.training and self.num_denoising > 0:
            if targets is None:
                raise ValueError("training with denoising needs the targets: model(images, "
                                 "targets)")
            dn_content, dn_ref, attn_mask, dn_meta = contrastive_denoising(
                targets, self.num_classes, self.num_queries, self.denoising_class_embed,
                self.num_denoising, self.label_noise, self.box_noise, generator,
                abs_sizes=True)
            content = torch.cat([dn_content.to(content.dtype), content], 1)
            ref_unact = torch.cat([dn_ref.to(ref_unact.dtype), ref_unact], 1)
        dec = self._decode(content, ref_unact, memory, shapes, attn_mask)
        pre_boxes, pre_logits = dec["pre"]
        dn: dict[str, list] = {}
        if dn_meta is not None:
            num_dn = dn_meta["dn_num_split"][0]
            for key in ("boxes", "logits", "corners", "refs"):
                dn[key] = [t[:, :num_dn] for t in dec[key]]
                dec[key] = [t[:, num_dn:] for t in dec[key]]
            dn_pre = {"pred_logits": pre_logits[:, :num_dn], "pred_boxes": pre_boxes[:, :num_dn]}
            pre_boxes, pre_logits = pre_boxes[:, num_dn:], pre_logits[:, num_dn:]
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
