"""DEIMv2's decoder (the published ``DEIMTransformer``, ``engine/deim/deim_decoder.py``):
D-FINE's query selection, denoising and Fine-grained Distribution Refinement
(:class:`~detr_irpe.models.dfine.decoder.DFINEDecoder`) with four changes:

1. no ``enc_output``: the proposal heads (``enc_score_head``, ``enc_bbox_head``) read
   the memory (valid anchors only) directly, and the top-k memory rows are the queries'
   content;
2. the layers are :class:`~detr_irpe.models.deimv2.decoder_layers.DEIMv2DecoderLayer`
   (RMS norms, SwiGLU FFN, the RMS gate or ``norm2``);
3. ``query_pos_head`` has three layers (4 -> C -> C -> C) and is evaluated once, on the
   initial reference boxes, for every layer (D-FINE: two layers, per layer on the
   current boxes);
4. ``share_bbox_head``: one ``dec_bbox_head`` module for every layer up to ``eval_idx``
   (its keys appear once per index in the state dict, the same tensors).

The LQE, the FDR constants (``up`` 0.5, ``reg_scale``) and their aliases under
``decoder.decoder``, the heads' keys and the training outputs are D-FINE's. Activations
are SiLU. The published module computes anchors for a fixed eval size (buffers
``anchors`` / ``valid_mask``); here they are computed for every input, as for D-FINE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from detr_irpe.models.deimv2.decoder_layers import (
    DEIMv2DecoderLayer,
    query_pos_head,
    query_position,
)
from detr_irpe.models.dfine.decoder import LQE, DFINEDecoder, DFINEDecoderSettings, LayerStack


@dataclass(frozen=True)
class DEIMv2DecoderSettings(DFINEDecoderSettings):
    """D-FINE's decoder settings (activation SiLU) and DEIMv2's two options.

    Attributes:
        use_gateway: the gate after the cross-attention (False: residual + ``norm2``).
        share_bbox_head: one box head for the layers up to ``eval_idx``.
    """

    activation: str = "silu"
    use_gateway: bool = True
    share_bbox_head: bool = False


class DEIMv2Decoder(DFINEDecoder):
    """Query selection + DEIMv2 layers + heads with FDR (module docstring), built from
    :class:`DEIMv2DecoderSettings`."""

    def __init__(self, settings: DEIMv2DecoderSettings | None = None) -> None:
        super().__init__(settings if settings is not None else DEIMv2DecoderSettings())
        hidden = self.settings.hidden_dim
        # replaces the shared 2-layer head in place (same position in the state dict)
        self.query_pos_head = query_pos_head(hidden, self.activation)
        for layer in self.query_pos_head.layers:
            nn.init.xavier_uniform_(layer.weight)

    def build_layers(self, s: DEIMv2DecoderSettings) -> None:
        self.up = nn.Parameter(torch.tensor([float(s.up)]), requires_grad=False)
        self.reg_scale = nn.Parameter(torch.tensor([float(s.reg_scale)]), requires_grad=False)
        self.decoder = LayerStack(
            [DEIMv2DecoderLayer(s.hidden_dim, s.nhead, s.dim_feedforward, s.dropout,
                                s.num_points, s.use_gateway) for _ in range(s.num_layers)],
            [LQE(s.reg_max, activation=s.activation) for _ in range(s.num_layers)],
            self.up, self.reg_scale)

    def build_enc_output(self, hidden: int) -> nn.Module:
        return nn.Identity()

    def build_box_heads(self, s: DEIMv2DecoderSettings) -> None:
        self.pre_bbox_head = self.mlp(s.hidden_dim, s.hidden_dim, 4, 3)
        width = 4 * (s.reg_max + 1)
        shared_until = s.eval_idx % s.num_layers + 1
        if s.share_bbox_head:
            shared = self.mlp(s.hidden_dim, s.hidden_dim, width, 3)
            heads = [shared] * shared_until + [
                self.mlp(s.hidden_dim, s.hidden_dim, width, 3)
                for _ in range(s.num_layers - shared_until)]
        else:
            heads = [self.mlp(s.hidden_dim, s.hidden_dim, width, 3)
                     for _ in range(s.num_layers)]
        self.dec_bbox_head = nn.ModuleList(heads)

    def box_heads(self) -> list:
        # a shared head once
        unique = list({id(h): h for h in self.dec_bbox_head}.values())
        return [self.enc_bbox_head, self.pre_bbox_head, *unique]

    def layer_query_pos(self, reference: Tensor, ref_unact: Tensor,
                        previous: Tensor | None) -> Tensor:
        """One query position embedding for every layer, computed once from the initial
        references (the published decoder's; D-FINE's recomputes it per layer)."""
        return query_position(self.query_pos_head, ref_unact) if previous is None else previous
