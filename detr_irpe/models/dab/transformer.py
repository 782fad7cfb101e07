"""DAB-DETR's transformer (Liu et al., ICLR 2022): dynamic anchor boxes as decoder queries.

Written from the paper and checked against the official code (docs/model.md, "DAB-DETR
and DN-DETR"). What it is, batch-first ``(B, L, C)`` throughout:

- **Encoder**: DETR's post-norm encoder (:class:`~.transformer.TransformerEncoder`, so
  iRPE composes as in DETR: ``rpe=...``) with PReLU layers and one ``query_scale`` MLP
  that rescales the position encoding from each layer's input (``pos * query_scale(x)``).
- **Decoder** (:class:`DABDecoder`): each query is a box ``(x, y, w, h)`` (sigmoid space).
  Per layer the box's sine embedding (:func:`anchor_sine_embedding`) gives the query
  position (``ref_point_head``); the cross-attention is conditional (Conditional DETR):
  per head, content and position are concatenated, ``[q_c, q_s]`` against ``[k_c, k_p]``,
  so a logit is ``q_c . k_c + q_s . k_p``. The spatial query ``q_s`` is the (x, y) sine
  embedding scaled element-wise by ``query_scale(content)`` (not in layer 0) and its
  x / y halves by ``w_ref / w`` / ``h_ref / h`` (``ref_anchor_head``): the attention
  spreads with the box's width and height. After each layer the shared box head moves
  the box (``sigmoid(bbox_embed(x) + inverse_sigmoid(box))``, detached for the next layer).

Module names are the official ones (``sa_qcontent_proj`` ... ``ca_qpos_sine_proj``,
``self_attn.out_proj``, ``cross_attn.out_proj``, ``ref_point_head``, ``ref_anchor_head``,
``query_scale``), so public DAB-DETR / DN-DETR checkpoints load without renaming. The
official code fixes the anchor embedding at 128 features per coordinate; here it is
``hidden_dim / 2`` (the same for hidden_dim 256), so any width works.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.attention.dropout import Dropout
from detr_irpe.encodings import PlaceEncodings, as_place
from detr_irpe.models.detr.transformer import (
    TransformerEncoder,
    TransformerEncoderLayer,
    add_feed_forward,
    feed_forward,
    reset_parameters,
)
from detr_irpe.models.mlp import MLP
from detr_irpe.models.position_encoding import sine_features

# Box coordinates are clamped this far from 0 and 1 before the logit (the official value).
INVERSE_SIGMOID_EPS = 1e-3


def inverse_sigmoid(x: Tensor, eps: float = INVERSE_SIGMOID_EPS) -> Tensor:
    """``log(x / (1 - x))`` of ``x`` clamped to [0, 1], each of ``x`` and ``1 - x`` at least
    ``eps``: finite for boxes that touch the image border."""
    x = x.clamp(0.0, 1.0)
    return torch.log(x.clamp(min=eps) / (1.0 - x).clamp(min=eps))


def anchor_sine_embedding(boxes: Tensor, num_feats: int) -> Tensor:
    """``(..., 4)`` boxes ``(x, y, w, h)`` in [0, 1] -> ``(..., 4 * num_feats)``: the sine
    features (temperature 10000) of each coordinate times ``2 pi``, in the order y, x, w, h
    (y before x, like the feature map's encoding, so that the first ``2 * num_feats``
    features are the position)."""
    scaled = boxes * (2 * math.pi)
    x, y, w, h = scaled.unbind(-1)
    return torch.cat([sine_features(v, num_feats, 10000.0) for v in (y, x, w, h)], dim=-1)


def _split_heads(x: Tensor, nhead: int) -> Tensor:
    """``(B, L, H * D)`` -> ``(B, H, L, D)``."""
    batch, length, width = x.shape
    return x.view(batch, length, nhead, width // nhead).transpose(1, 2)


def _concat_heads(a: Tensor, b: Tensor, nhead: int) -> Tensor:
    """``(B, L, H * D)`` twice -> ``(B, L, H * 2D)``: per head, ``a``'s features then ``b``'s."""
    batch, length, width = a.shape
    pair = torch.cat(
        (a.view(batch, length, nhead, width // nhead), b.view(batch, length, nhead, width // nhead)),
        dim=-1,
    )
    return pair.view(batch, length, 2 * width)


class ProjectedAttention(nn.Module):
    """Multi-head attention of already projected queries, keys and values + ``out_proj``.

    DAB-DETR projects q, k, v with its own named layers (content and position apart), so
    the attention module holds only the output projection (key ``out_proj``). Queries and
    keys may be wider than the values (the cross-attention's ``2 * C``); the scale is
    ``1 / sqrt(query head width)``.
    """

    def __init__(self, embed_dim: int, nhead: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.nhead = nhead
        self.dropout = dropout
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """``q`` ``(B, Lq, H * Dq)``, ``k`` ``(B, Lk, H * Dq)``, ``v`` ``(B, Lk, C)``;
        ``key_padding_mask`` ``(B, Lk)`` and ``attn_mask`` ``(Lq, Lk)`` bool, True = may not
        attend -> ``(B, Lq, C)``."""
        allowed = None
        if key_padding_mask is not None:
            allowed = ~key_padding_mask[:, None, None, :]
        if attn_mask is not None:
            allowed = ~attn_mask if allowed is None else allowed & ~attn_mask
        out = F.scaled_dot_product_attention(
            _split_heads(q, self.nhead),
            _split_heads(k, self.nhead),
            _split_heads(v, self.nhead),
            attn_mask=allowed,
            dropout_p=self.dropout if self.training else 0.0,
        )  # (B, H, Lq, C / H)
        return self.out_proj(out.transpose(1, 2).flatten(2))

    @torch.no_grad()
    def attention_weights(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """The softmax weights :meth:`forward` applies to the values (no dropout), for
        figures: ``q`` ``(B, Lq, H * Dq)``, ``k`` ``(B, Lk, H * Dq)``, masks as in
        :meth:`forward` -> ``(B, H, Lq, Lk)``, each row summing to 1 over the allowed keys."""
        qh, kh = _split_heads(q, self.nhead), _split_heads(k, self.nhead)
        logits = qh @ kh.transpose(-2, -1) / math.sqrt(qh.shape[-1])
        if key_padding_mask is not None:
            logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        if attn_mask is not None:
            logits = logits.masked_fill(attn_mask, float("-inf"))
        return logits.softmax(-1)


class DABDecoderLayer(nn.Module):
    """Self-attention over the queries, conditional cross-attention to the memory, FFN
    (post-norm). ``first``: the layer that also adds the query position to the content
    query and key of the cross-attention (``ca_qpos_proj``; only layer 0 has it)."""

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.0,
        activation: str = "prelu",
        first: bool = False,
    ) -> None:
        super().__init__()
        self.sa_qcontent_proj = nn.Linear(d_model, d_model)
        self.sa_qpos_proj = nn.Linear(d_model, d_model)
        self.sa_kcontent_proj = nn.Linear(d_model, d_model)
        self.sa_kpos_proj = nn.Linear(d_model, d_model)
        self.sa_v_proj = nn.Linear(d_model, d_model)
        self.self_attn = ProjectedAttention(d_model, nhead, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)

        self.ca_qcontent_proj = nn.Linear(d_model, d_model)
        self.ca_qpos_proj = nn.Linear(d_model, d_model) if first else None
        self.ca_kcontent_proj = nn.Linear(d_model, d_model)
        self.ca_kpos_proj = nn.Linear(d_model, d_model)
        self.ca_v_proj = nn.Linear(d_model, d_model)
        self.ca_qpos_sine_proj = nn.Linear(d_model, d_model)
        self.cross_attn = ProjectedAttention(d_model, nhead, dropout)

        add_feed_forward(self, d_model, dim_feedforward, dropout, activation)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.nhead = nhead

    def _ffn(self, x: Tensor) -> Tensor:
        return self.dropout3(feed_forward(self, x))

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        pos: Tensor,
        query_pos: Tensor,
        query_sine: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        self_attn_mask: Tensor | None = None,
    ) -> Tensor:
        """``tgt``, ``query_pos`` (from the anchor), ``query_sine`` (the modulated (x, y)
        sine embedding) ``(B, Q, C)``; ``memory``, ``pos`` ``(B, L, C)``;
        ``memory_key_padding_mask`` ``(B, L)`` and ``self_attn_mask`` ``(Q, Q)`` bool, True =
        may not attend -> ``(B, Q, C)``."""

        def self_attend(x: Tensor) -> Tensor:
            q = self.sa_qcontent_proj(x) + self.sa_qpos_proj(query_pos)
            k = self.sa_kcontent_proj(x) + self.sa_kpos_proj(query_pos)
            out = self.self_attn(q, k, self.sa_v_proj(x), attn_mask=self_attn_mask)
            return self.dropout1(out)

        def cross_attend(x: Tensor) -> Tensor:
            q = self.ca_qcontent_proj(x)
            k = self.ca_kcontent_proj(memory)
            k_pos = self.ca_kpos_proj(pos)
            if self.ca_qpos_proj is not None:
                q = q + self.ca_qpos_proj(query_pos)
                k = k + k_pos
            q = _concat_heads(q, self.ca_qpos_sine_proj(query_sine), self.nhead)
            k = _concat_heads(k, k_pos, self.nhead)
            out = self.cross_attn(q, k, self.ca_v_proj(memory),
                                  key_padding_mask=memory_key_padding_mask)
            return self.dropout2(out)

        x = self.norm1(tgt + self_attend(tgt))  # post-norm only, as DAB-DETR
        x = self.norm2(x + cross_attend(x))
        return self.norm3(x + self._ffn(x))


class DABDecoder(nn.Module):
    """The decoder stack: anchors in, every layer's normed output and starting box out.

    ``bbox_embed`` is the detector's box head, attached by :class:`~.dab_detr.DABDETR`
    (the same module under both names, as in the official model): it refines the anchors
    between the layers.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        num_layers: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.0,
        activation: str = "prelu",
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DABDecoderLayer(d_model, nhead, dim_feedforward, dropout, activation, first=i == 0)
            for i in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        # Layer 0 does not scale its spatial query: one layer needs no query_scale (an
        # unused parameter would also stop DistributedDataParallel).
        self.query_scale = MLP(d_model, d_model, d_model, 2) if num_layers > 1 else None
        self.ref_point_head = MLP(2 * d_model, d_model, d_model, 2)
        self.ref_anchor_head = MLP(d_model, d_model, 2, 2)
        self.bbox_embed: nn.Module | None = None
        self.d_model = d_model

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        pos: Tensor,
        anchors: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        self_attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run the layers with iterative box refinement.

        Args:
            tgt: ``(B, Q, C)`` content queries.
            memory, pos: ``(B, L, C)`` encoder output and its position encoding.
            anchors: ``(B, Q, 4)`` boxes ``(x, y, w, h)`` before the sigmoid.
            memory_key_padding_mask: ``(B, L)`` bool, True on padding.
            self_attn_mask: ``(Q, Q)`` bool, True = query i may not see query j.

        Returns:
            hs: ``(num_layers, B, Q, C)``, ``norm(output of layer l)``.
            boxes: ``(num_layers, B, Q, 4)`` the box (sigmoid space) layer ``l`` started
            from: ``sigmoid(anchors)``, then each earlier layer's refinement, kept in the
            graph (the head adds its offsets to them); the decoder itself feeds the next
            layer a detached copy.
        """
        if self.bbox_embed is None:
            raise RuntimeError("DABDecoder.bbox_embed is not set: DABDETR attaches its box head")
        half = self.d_model // 2
        box = anchors.sigmoid()
        starts = [box]
        hs = []
        x = tgt
        for i, layer in enumerate(self.layers):
            sine = anchor_sine_embedding(box, half)  # (B, Q, 2C): y, x, w, h
            query_pos = self.ref_point_head(sine)
            sine_yx = sine[..., : self.d_model]
            if i > 0:
                sine_yx = sine_yx * self.query_scale(x)
            # Width / height modulation: the reference size over the box's own size.
            ref_wh = self.ref_anchor_head(x).sigmoid()
            query_sine = torch.cat(
                (sine_yx[..., :half] * (ref_wh[..., 1] / box[..., 3]).unsqueeze(-1),
                 sine_yx[..., half:] * (ref_wh[..., 0] / box[..., 2]).unsqueeze(-1)),
                dim=-1,
            )
            x = layer(x, memory, pos, query_pos, query_sine,
                      memory_key_padding_mask=memory_key_padding_mask,
                      self_attn_mask=self_attn_mask)
            refined = (self.bbox_embed(x) + inverse_sigmoid(box)).sigmoid()
            if i < len(self.layers) - 1:
                starts.append(refined)
            box = refined.detach()
            hs.append(self.norm(x))
        return torch.stack(hs), torch.stack(starts)


class DABTransformer(nn.Module):
    """DAB-DETR's encoder-decoder; the encoder self-attention carries iRPE.

    Args:
        d_model: token width C (divisible by 4: the anchor embedding's sin / cos pairs).
        nhead: attention heads.
        num_encoder_layers, num_decoder_layers: depths (the encoder may be 0).
        dim_feedforward: FFN hidden width.
        dropout: dropout of attention weights, residual branches and FFN (DAB-DETR: 0).
        encodings: the encodings of the encoder self-attention (as DETR's).
        rpe_init: how the iRPE tables start (``xavier`` or ``zero``, as in DETR).
        activation: FFN activation of every layer (DAB-DETR: ``prelu``).
    """

    def __init__(
        self,
        d_model: int = 256,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.0,
        encodings: PlaceEncodings | Sequence[str] | None = None,
        rpe_init: str = "xavier",
        activation: str = "prelu",
    ) -> None:
        super().__init__()
        if d_model % 4:
            raise ValueError(f"d_model must be divisible by 4 for the anchor embedding, got {d_model}")
        self.encoder = TransformerEncoder(
            [
                TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, False,
                                        activation, encodings=as_place(encodings))
                for _ in range(num_encoder_layers)
            ],
            None,
            # no encoder layer, no scale (an unused parameter would stop DDP)
            query_scale=MLP(d_model, d_model, d_model, 2) if num_encoder_layers else None,
        )
        self.decoder = DABDecoder(
            d_model, nhead, num_decoder_layers, dim_feedforward, dropout, activation
        )
        self.d_model = d_model
        self.nhead = nhead
        self.rpe_init = rpe_init
        reset_parameters(self, rpe_init)

    def forward(
        self,
        src: Tensor,
        mask: Tensor,
        pos: Tensor,
        anchors: Tensor,
        tgt: Tensor,
        self_attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Encode a feature map and decode the anchor queries.

        Args:
            src: ``(B, C, H, W)`` projected backbone features.
            mask: ``(B, H, W)`` bool, True on padding.
            pos: ``(B, C, H, W)`` absolute position encoding.
            anchors: ``(B, Q, 4)`` query boxes before the sigmoid.
            tgt: ``(B, Q, C)`` content queries.
            self_attn_mask: ``(Q, Q)`` bool, True = blocked (the denoising mask).

        Returns:
            hs ``(num_decoder_layers, B, Q, C)``, the boxes each layer started from
            ``(num_decoder_layers, B, Q, 4)`` and the memory ``(B, C, H, W)``.
        """
        batch, channels, height, width = src.shape
        src = src.flatten(2).transpose(1, 2)  # (B, L, C), row-major tokens
        pos = pos.flatten(2).transpose(1, 2)
        key_padding_mask = mask.flatten(1)
        memory = self.encoder(src, (height, width), key_padding_mask=key_padding_mask, pos=pos)
        hs, starts = self.decoder(tgt, memory, pos, anchors, key_padding_mask, self_attn_mask)
        return hs, starts, memory.transpose(1, 2).reshape(batch, channels, height, width)
