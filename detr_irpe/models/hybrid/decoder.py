"""What the decoders of the hybrid-encoder families share (RT-DETR's, D-FINE's): the
memory, the anchors, IoU-aware query selection, the contrastive denoising queries, the
heads every family has, their initialisation, and the split of the outputs into
denoising and matching queries.

1. The encoder's maps are projected (1x1 conv + BatchNorm per level, where a family
   projects) and flattened into one memory ``(B, L, C)``, ``L = sum_l H_l W_l``
   (row-major per level, finest first); levels beyond the encoder's maps come from 3x3 / 2
   conv + BatchNorm units.
2. Query selection: every memory token is a proposal. Its anchor is a box centred on
   its cell, of size ``0.05 * 2**l`` at level ``l``, in ``inverse_sigmoid`` space; anchors
   with any coordinate outside ``(eps, 1 - eps)`` are invalid (their memory is zeroed and
   their anchor is +inf). ``enc_output`` (Linear + LayerNorm) turns the memory into
   proposal features, scored by ``enc_score_head``; the ``Q`` proposals of highest
   best-class score become the decoder's queries, their boxes ``enc_bbox_head(features)
   + anchor``.
3. With denoising in training, the contrastive queries
   (:func:`~detr_irpe.models.hybrid.denoising.contrastive_denoising`) come before the
   ``Q`` matching queries, and the self-attention mask keeps the two apart.

Anchors are computed from the actual feature sizes at every call, also in eval mode
(the published code caches them for a 640 x 640 input there; identical at that size and
failing at any other). They are float32 numbers, as published, whatever the model's dtype.

A family's decoder (:class:`HybridDecoder` subclass) builds its layers
(:meth:`~HybridDecoder.build_layers`), its box heads (:meth:`~HybridDecoder.build_box_heads`)
and its input projections, and runs its own layer loop; the registration order of the
modules is the published one, so the state-dict keys are.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import ClassVar

import torch
from torch import Tensor, nn

from detr_irpe.errors import ConfigError
from detr_irpe.models.hybrid.denoising import contrastive_denoising
from detr_irpe.models.hybrid.settings import DecoderSettings
from detr_irpe.models.mlp import MLP

Shapes = list[tuple[int, int]]


def generate_anchors(spatial_shapes: Shapes, grid_size: float = 0.05,
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
                   ) -> tuple[Tensor, Shapes]:
    """The decoder's memory ``(B, sum H_l W_l, C)`` and the level shapes: each encoder map
    through its projection, and ``num_levels - len(feats)`` extra levels, the first from
    the last map, each next from the level before (the projections do the striding)."""
    maps = [proj(f) for proj, f in zip(input_proj, feats)]
    for lvl in range(len(feats), num_levels):
        source = feats[-1] if lvl == len(feats) else maps[-1]
        maps.append(input_proj[lvl](source))
    shapes = [(m.shape[2], m.shape[3]) for m in maps]
    return torch.cat([m.flatten(2).transpose(1, 2) for m in maps], 1), shapes


def conv_norm(c_in: int, c_out: int, kernel: int = 1, stride: int = 1) -> nn.Sequential:
    """``conv`` (no bias, ``kernel // 2`` padding) + ``norm`` (BatchNorm)."""
    return nn.Sequential(OrderedDict([
        ("conv", nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False)),
        ("norm", nn.BatchNorm2d(c_out))]))


def input_projections(settings: DecoderSettings, *, identity_when_equal: bool
                      ) -> nn.ModuleList:
    """One unit per memory level: a 1x1 conv + BatchNorm per encoder map (an identity for a
    map already ``hidden_dim`` wide, with ``identity_when_equal``), then a 3x3 / 2 one per
    extra level."""
    channels, hidden = settings.feat_channels, settings.hidden_dim
    units = []
    for lvl in range(settings.num_levels):
        if lvl < len(channels):
            c_in, kernel, stride = channels[lvl], 1, 1
        else:
            c_in = channels[-1] if lvl == len(channels) else hidden
            kernel, stride = 3, 2
        if identity_when_equal and c_in == hidden and kernel == 1:
            units.append(nn.Identity())
        else:
            units.append(conv_norm(c_in, hidden, kernel, stride))
    return nn.ModuleList(units)


def self_attention(layer: nn.Module, x: Tensor, query_pos: Tensor,
                   attn_mask: Tensor | None) -> Tensor:
    """A decoder layer's post-norm self-attention block: ``norm1(x + dropout1(attn))``, the
    query position added to queries and keys (``layer.self_attn``: torch MHA)."""
    qk = x + query_pos
    return layer.norm1(x + layer.dropout1(
        layer.self_attn(qk, qk, x, attn_mask=attn_mask, need_weights=False)[0]))


def feed_forward(layer: nn.Module, x: Tensor, activation) -> Tensor:
    """A decoder layer's post-norm feed-forward block:
    ``norm3(x + dropout4(linear2(dropout3(act(linear1(x))))))``."""
    ffn = layer.linear2(layer.dropout3(activation(layer.linear1(x))))
    # the clamp keeps fp16 finite (65504: its largest value), as published
    return layer.norm3((x + layer.dropout4(ffn)).clamp(-65504, 65504))


def split_denoising(outputs: dict[str, list[Tensor]], num_dn: int
                    ) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
    """``(denoising, matching)``: every tensor of every list of ``outputs`` split at query
    ``num_dn`` (the denoising queries come first)."""
    dn = {key: [t[:, :num_dn] for t in values] for key, values in outputs.items()}
    rest = {key: [t[:, num_dn:] for t in values] for key, values in outputs.items()}
    return dn, rest


class HybridDecoder(nn.Module):
    """The shared part of RT-DETR's and D-FINE's decoders (module docstring).

    Built from :class:`~detr_irpe.models.hybrid.settings.DecoderSettings` (a family's
    extension of it). Registers, in this order: ``input_proj``, the family's layers
    (:meth:`build_layers`), ``denoising_class_embed`` (with denoising), the family's query
    modules (:meth:`build_queries`), ``query_pos_head``, ``enc_output``, ``enc_score_head``,
    ``enc_bbox_head``, ``dec_score_head.{i}``, the family's box heads
    (:meth:`build_box_heads`).
    """

    # the denoising boxes' negative sizes made positive (D-FINE) or kept (RT-DETR)
    DENOISING_ABS_SIZES: ClassVar[bool] = False
    # the denoising queries cast to the matching queries' dtype (D-FINE) before they are
    # put together, or promoted with them (RT-DETR)
    DENOISING_IN_QUERY_DTYPE: ClassVar[bool] = False

    def __init__(self, settings: DecoderSettings) -> None:
        super().__init__()
        s = settings
        self.settings = settings
        self.num_classes = s.num_classes
        self.hidden_dim = s.hidden_dim
        self.num_queries = s.num_queries
        self.num_levels = s.num_levels
        self.num_layers = s.num_layers
        self.eval_idx = s.eval_idx % s.num_layers
        self.eps = s.eps
        self.aux_loss = s.aux_loss
        self.num_denoising = s.num_denoising
        self.label_noise = s.label_noise
        self.box_noise = s.box_noise
        self.activation = s.mlp_activation()

        self.input_proj = self.build_input_projections(s)
        self.num_input_maps = len(s.feat_channels)
        self.build_layers(s)
        if s.num_denoising > 0:
            self.denoising_class_embed = nn.Embedding(s.num_classes + 1, s.hidden_dim,
                                                      padding_idx=s.num_classes)
        self.build_queries(s)
        hidden = s.hidden_dim
        self.query_pos_head = self.mlp(4, 2 * hidden, hidden, 2)
        self.enc_output = self.build_enc_output(hidden)
        self.enc_score_head = nn.Linear(hidden, s.num_classes)
        self.enc_bbox_head = self.mlp(hidden, hidden, 4, 3)
        self.dec_score_head = nn.ModuleList(nn.Linear(hidden, s.num_classes)
                                            for _ in range(s.num_layers))
        self.build_box_heads(s)
        self._reset_parameters()

    # ------------------------------------------------------------ the family's parts
    def mlp(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int) -> MLP:
        """An MLP head with the decoder's activation."""
        return MLP(input_dim, hidden_dim, output_dim, num_layers, self.activation)

    def build_input_projections(self, settings: DecoderSettings) -> nn.ModuleList:
        """``input_proj``: a conv + BatchNorm unit per level."""
        return input_projections(settings, identity_when_equal=False)

    def build_layers(self, settings: DecoderSettings) -> None:
        """Register the decoder layers (``decoder``)."""
        raise NotImplementedError

    def build_queries(self, settings: DecoderSettings) -> None:
        """Register the family's query modules (none by default)."""

    def build_enc_output(self, hidden: int) -> nn.Module:
        """``enc_output``: Linear + LayerNorm (keys ``0``, ``1``); a family without one
        (DEIMv2: the heads read the memory) returns ``nn.Identity()``."""
        return nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden))

    def build_box_heads(self, settings: DecoderSettings) -> None:
        """Register the family's box heads (``dec_bbox_head`` and the like)."""
        raise NotImplementedError

    def box_heads(self) -> list[MLP]:
        """The box heads whose last layer starts at zero (the first boxes are the anchors,
        then the references)."""
        return [self.enc_bbox_head, *self.dec_bbox_head]

    def reset_family_parameters(self) -> None:
        """The family's own initialisation (after the shared heads', before the denoising
        embedding's: the order of the random draws is the published one)."""

    def _reset_parameters(self) -> None:
        # class heads start at a prior probability of 0.01 (focal-loss practice), box
        # heads at zero
        prior = -math.log((1 - 0.01) / 0.01)
        for score in [self.enc_score_head, *self.dec_score_head]:
            nn.init.constant_(score.bias, prior)
        for box in self.box_heads():
            nn.init.zeros_(box.layers[-1].weight)
            nn.init.zeros_(box.layers[-1].bias)
        if isinstance(self.enc_output, nn.Sequential):
            nn.init.xavier_uniform_(self.enc_output[0].weight)
        nn.init.xavier_uniform_(self.query_pos_head.layers[0].weight)
        nn.init.xavier_uniform_(self.query_pos_head.layers[1].weight)
        self.reset_family_parameters()
        if self.num_denoising > 0:
            with torch.no_grad():
                nn.init.normal_(self.denoising_class_embed.weight[:-1])

    # ---------------------------------------------------------------- the steps
    def forward(self, feats: list[Tensor], targets: list[dict] | None = None,
                generator: torch.Generator | None = None) -> dict:
        """
        Args:
            feats: the encoder's maps ``(B, C_l, H_l, W_l)``, finest first.
            targets: in training with denoising, B dicts with ``labels`` (class indices)
                and ``boxes`` (cxcywh normalised).
            generator: the denoising noise's random source (None: torch's global RNG).

        Returns:
            the family's outputs (:meth:`decode`): ``pred_logits`` ``(B, Q, C)``,
            ``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1], in eval mode also the selected
            proposals the decoder started from, ``enc_topk_boxes`` ``(B, Q, 4)`` and
            ``enc_topk_logits`` ``(B, Q, C)`` in the order of the queries; in training
            the family's loss inputs.
        """
        memory, shapes = decoder_memory(self.input_proj, feats, self.num_levels)
        return self.decode(memory, shapes, targets, generator)

    def decode(self, memory: Tensor, shapes: Shapes, targets: list[dict] | None,
               generator: torch.Generator | None) -> dict:
        """The outputs (:meth:`forward`) of the memory ``(B, L, C)`` of levels ``shapes``."""
        raise NotImplementedError

    def _proposals(self, memory: Tensor, shapes: Shapes
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """-> every token's proposal features ``(B, L, C)``, class logits ``(B, L, C)``
        and anchor ``(1, L, 4)``, and the indices of the ``Q`` best ``(B, Q)``."""
        anchors, valid = generate_anchors(shapes, eps=self.eps, device=memory.device)
        features = self.enc_output(valid.to(memory.dtype) * memory)
        logits = self.enc_score_head(features)
        if memory.shape[1] < self.num_queries and not torch.compiler.is_exporting():
            sides = " + ".join(f"{h}x{w}" for h, w in shapes)
            raise ConfigError(
                f"model.num_queries={self.num_queries} is more than the {memory.shape[1]} "
                f"proposals of this input's feature maps ({sides}): give a larger image or "
                "fewer queries")
        top = logits.max(-1).values.topk(self.num_queries, dim=1).indices  # (B, Q)
        return features, logits, anchors, top

    @staticmethod
    def pick(x: Tensor, top: Tensor) -> Tensor:
        """The rows ``top`` ``(B, Q)`` of ``x`` ``(B or 1, L, D)`` -> ``(B, Q, D)``."""
        x = x.expand(top.shape[0], -1, -1)
        return x.gather(1, top[..., None].expand(-1, -1, x.shape[-1]))

    def _with_denoising(self, content: Tensor, ref_unact: Tensor, targets: list[dict] | None,
                        generator: torch.Generator | None
                        ) -> tuple[Tensor, Tensor, Tensor | None, dict | None]:
        """In training with denoising, the denoising queries put before ``content`` and
        ``ref_unact``, with the self-attention mask and ``dn_meta``; else the queries as
        they are and ``None, None``."""
        if not (self.training and self.num_denoising > 0):
            return content, ref_unact, None, None
        if targets is None:
            raise ValueError("training with denoising needs the targets: model(images, "
                             "targets)")
        dn_content, dn_ref, attn_mask, dn_meta = contrastive_denoising(
            targets, self.denoising_class_embed, self.num_queries,
            self.settings.denoising(self.DENOISING_ABS_SIZES), generator)
        if self.DENOISING_IN_QUERY_DTYPE:
            dn_content, dn_ref = dn_content.to(content.dtype), dn_ref.to(ref_unact.dtype)
        return (torch.cat([dn_content, content], 1), torch.cat([dn_ref, ref_unact], 1),
                attn_mask, dn_meta)
