"""DETR transformer with iRPE in the encoder self-attention.

Adapted from DETR's ``transformer.py`` (itself a copy of ``torch.nn.Transformer``).
What changed:

- batch-first everywhere: ``(B, L, C)`` tokens, ``(B, L)`` padding masks;
- every encoder self-attention is a :class:`~detr_irpe.attention.MultiheadAttention`
  over the ``H x W`` token grid with the encoder's encoding entries (plain attention
  without any), so the encoder layers also take the grid size ``hw``;
- post-norm / pre-norm is one ``forward`` with a branch (``_residual``) instead
  of DETR's duplicated ``forward_post`` / ``forward_pre``;
- how the iRPE tables start is a choice (``rpe_init``): ``xavier`` is DETR's own
  parameter reset, which re-initialises every matrix including the tables (the
  published iRPE-DETR recipe); ``zero`` makes a fresh iRPE model compute exactly the
  model without iRPE.
- the encoder self-attention takes any encodings of the registry
  (:mod:`detr_irpe.encodings`: iRPE, a rotation of q and k, a plugin's), alone or
  together and with the absolute encoding; the reset leaves the parameters of encodings
  that start their own way as they were started.
- the encoder is also DAB-DETR's (``models/dab_transformer.py``): its layers take an
  ``activation`` (``prelu``: one learned slope per layer, key ``activation.weight``), and
  the stack an optional ``query_scale`` MLP that rescales the position encoding from
  each layer's input.

Parameter names are DETR's (``self_attn``, ``multihead_attn``, ``linear1``,
``linear2``, ``norm1..3``, ``decoder.norm``), so public DETR and iRPE-DETR
checkpoints load. Pre-norm adds a final encoder LayerNorm
(``transformer.encoder.norm.*``), as in DETR; post-norm has none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.attention import MultiheadAttention, entry_owners
from detr_irpe.attention.dropout import Dropout
from detr_irpe.encodings import PlaceEncodings, as_place
from detr_irpe.irpe import RPE_INIT_MODES

ACTIVATIONS = ("relu", "prelu")


def reset_parameters(module: nn.Module, rpe_init: str) -> None:
    """DETR's reset of a transformer: ``xavier_uniform_`` on every matrix but the
    attention encodings', which start themselves where their parameters come
    (:func:`~detr_irpe.attention.init_entries`: iRPE's tables as ``rpe_init`` says, xavier
    as in DETR-with-iRPE or zero; RoPE-Mixed's frequencies keep their start, which a
    xavier draw would lose)."""
    if rpe_init not in RPE_INIT_MODES:
        raise ValueError(f"rpe_init must be one of {', '.join(RPE_INIT_MODES)}, got {rpe_init!r}")
    owners = entry_owners(module)
    started: set[int] = set()
    for name, param in module.named_parameters():
        entry = owners.get(name)
        if entry is not None:
            # at its first parameter: the RNG order of a reset that drew every matrix
            if id(entry) not in started:
                started.add(id(entry))
                entry.init_parameters(rpe_init)
        elif param.dim() > 1:
            nn.init.xavier_uniform_(param)


def make_activation(name: str) -> Callable[[Tensor], Tensor]:
    """``relu`` (a function: no parameter) or ``prelu`` (a module with one learned slope,
    so a layer holding it has the key ``activation.weight``, as in DAB-DETR)."""
    if name == "relu":
        return F.relu
    if name == "prelu":
        return nn.PReLU()
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}")


def add_feed_forward(
    layer: nn.Module, d_model: int, dim_feedforward: int, dropout: float, activation: str
) -> None:
    """Give ``layer`` the feed-forward block under DETR's names (``linear1``, ``dropout``,
    ``linear2``, ``activation``), which public checkpoints use."""
    layer.linear1 = nn.Linear(d_model, dim_feedforward)
    layer.dropout = Dropout(dropout)
    layer.linear2 = nn.Linear(dim_feedforward, d_model)
    layer.activation = make_activation(activation)


def feed_forward(layer: nn.Module, x: Tensor) -> Tensor:
    """``linear2(dropout(activation(linear1(x))))`` of a layer set up by :func:`add_feed_forward`."""
    return layer.linear2(layer.dropout(layer.activation(layer.linear1(x))))


def _residual(
    x: Tensor, norm: nn.LayerNorm, fn: Callable[[Tensor], Tensor], pre_norm: bool
) -> Tensor:
    """Post-norm ``norm(x + fn(x))`` or pre-norm ``x + fn(norm(x))``."""
    if pre_norm:
        return x + fn(norm(x))
    return norm(x + fn(x))


def _with_pos(x: Tensor, pos: Tensor | None) -> Tensor:
    return x if pos is None else x + pos


class TransformerEncoderLayer(nn.Module):
    """Self-attention with the encodings of ``encodings`` (encoding strings or a
    :class:`~detr_irpe.encodings.PlaceEncodings`: iRPE, RoPE, a plugin's; the absolute
    positions are added to queries and keys, not values, by the caller) + FFN."""

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        pre_norm: bool = False,
        activation: str = "relu",
        encodings: PlaceEncodings | Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout,
            encodings=as_place(encodings).attention_encodings(d_model, nhead))
        add_feed_forward(self, d_model, dim_feedforward, dropout, activation)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.pre_norm = pre_norm

    def _ffn(self, x: Tensor) -> Tensor:
        return self.dropout2(feed_forward(self, x))

    def forward(
        self,
        src: Tensor,
        hw: tuple[int, int],
        key_padding_mask: Tensor | None = None,
        pos: Tensor | None = None,
    ) -> Tensor:
        """``src``, ``pos`` ``(B, L, C)`` with ``L = H * W`` = ``hw`` in row-major
        order; ``key_padding_mask`` ``(B, L)`` True = pad -> ``(B, L, C)``."""

        def attend(x: Tensor) -> Tensor:
            qk = _with_pos(x, pos)
            out = self.self_attn(qk, qk, x, hw, key_padding_mask=key_padding_mask)[0]
            return self.dropout1(out)

        x = _residual(src, self.norm1, attend, self.pre_norm)
        return _residual(x, self.norm2, self._ffn, self.pre_norm)


class TransformerDecoderLayer(nn.Module):
    """Self-attention over queries, cross-attention to the memory, FFN.

    Object queries (``query_pos``) are added to the queries and keys of the
    self-attention and to the queries of the cross-attention; ``pos`` to its keys.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        pre_norm: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.multihead_attn = nn.MultiheadAttention(
            d_model, nhead, dropout=dropout, batch_first=True
        )
        add_feed_forward(self, d_model, dim_feedforward, dropout, "relu")
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)
        self.pre_norm = pre_norm

    def _ffn(self, x: Tensor) -> Tensor:
        return self.dropout3(feed_forward(self, x))

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        pos: Tensor | None = None,
        query_pos: Tensor | None = None,
    ) -> Tensor:
        """``tgt``, ``query_pos`` ``(B, Q, C)``; ``memory``, ``pos`` ``(B, L, C)``;
        ``memory_key_padding_mask`` ``(B, L)`` True = pad -> ``(B, Q, C)``."""

        def self_attend(x: Tensor) -> Tensor:
            qk = _with_pos(x, query_pos)
            return self.dropout1(self.self_attn(qk, qk, x, need_weights=False)[0])

        def cross_attend(x: Tensor) -> Tensor:
            out = self.multihead_attn(
                _with_pos(x, query_pos),
                _with_pos(memory, pos),
                memory,
                key_padding_mask=memory_key_padding_mask,
                need_weights=False,
            )[0]
            return self.dropout2(out)

        x = _residual(tgt, self.norm1, self_attend, self.pre_norm)
        x = _residual(x, self.norm2, cross_attend, self.pre_norm)
        return _residual(x, self.norm3, self._ffn, self.pre_norm)


class TransformerEncoder(nn.Module):
    """A stack of encoder layers, with a final LayerNorm in the pre-norm variant.

    With ``query_scale`` (DAB-DETR's encoder) layer ``i`` sees the position encoding
    ``pos * query_scale(x_i)``, ``x_i`` its own input, instead of ``pos``.
    """

    def __init__(
        self,
        layers: list[TransformerEncoderLayer],
        norm: nn.LayerNorm | None,
        query_scale: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.query_scale = query_scale  # None: no key, DETR's encoder

    def forward(
        self,
        src: Tensor,
        hw: tuple[int, int],
        key_padding_mask: Tensor | None = None,
        pos: Tensor | None = None,
    ) -> Tensor:
        """``(B, L, C)`` -> ``(B, L, C)``; arguments as :class:`TransformerEncoderLayer`."""
        x = src
        for layer in self.layers:
            layer_pos = pos
            if self.query_scale is not None and pos is not None:
                layer_pos = pos * self.query_scale(x)
            x = layer(x, hw, key_padding_mask=key_padding_mask, pos=layer_pos)
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(nn.Module):
    """A stack of decoder layers returning every layer's output through the shared final norm."""

    def __init__(self, layers: list[TransformerDecoderLayer], norm: nn.LayerNorm) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        pos: Tensor | None = None,
        query_pos: Tensor | None = None,
    ) -> Tensor:
        """-> ``(num_layers, B, Q, C)``: ``norm(output of layer i)`` for every layer."""
        x = tgt
        intermediate = []
        for layer in self.layers:
            x = layer(x, memory, memory_key_padding_mask, pos=pos, query_pos=query_pos)
            intermediate.append(self.norm(x))
        return torch.stack(intermediate)


class Transformer(nn.Module):
    """DETR encoder-decoder; the encoder self-attention carries iRPE.

    Args:
        d_model: token width C.
        nhead: attention heads.
        num_encoder_layers, num_decoder_layers: depths (encoder may be 0).
        dim_feedforward: FFN hidden width.
        dropout: dropout of attention weights, residual branches and FFN.
        pre_norm: pre-norm layers (adds ``encoder.norm``); default post-norm.
        encodings: the encodings of the encoder self-attention (encoding strings such as
            ``["rpe-2.0-product-ctx-1-k"]`` or a PlaceEncodings; the absolute
            one is added by the caller through ``pos``).
        rpe_init: how the iRPE tables start: ``xavier`` (the reference recipe) or ``zero``.
    """

    def __init__(
        self,
        d_model: int = 256,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        pre_norm: bool = False,
        encodings: PlaceEncodings | Sequence[str] | None = None,
        rpe_init: str = "xavier",
    ) -> None:
        super().__init__()
        encodings = as_place(encodings)
        self.encoder = TransformerEncoder(
            [
                TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, pre_norm,
                                        encodings=encodings)
                for _ in range(num_encoder_layers)
            ],
            nn.LayerNorm(d_model) if pre_norm else None,
        )
        self.decoder = TransformerDecoder(
            [
                TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout, pre_norm)
                for _ in range(num_decoder_layers)
            ],
            nn.LayerNorm(d_model),
        )
        self.d_model = d_model
        self.nhead = nhead
        self.rpe_init = rpe_init
        reset_parameters(self, rpe_init)

    def forward(
        self, src: Tensor, mask: Tensor, query_embed: Tensor, pos: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Run the encoder on a feature map and the decoder on the object queries.

        Args:
            src: ``(B, C, H, W)`` projected backbone features.
            mask: ``(B, H, W)`` bool, True on padding.
            query_embed: ``(Q, C)`` object queries.
            pos: ``(B, C, H, W)`` absolute position encoding.

        Returns:
            hs: ``(num_decoder_layers, B, Q, C)`` normed decoder outputs.
            memory: ``(B, C, H, W)`` encoder output.
        """
        batch, channels, height, width = src.shape
        src = src.flatten(2).transpose(1, 2)  # (B, L, C), row-major tokens
        pos = pos.flatten(2).transpose(1, 2)
        key_padding_mask = mask.flatten(1)
        query_pos = query_embed.unsqueeze(0).expand(batch, -1, -1)
        memory = self.encoder(src, (height, width), key_padding_mask=key_padding_mask, pos=pos)
        tgt = torch.zeros_like(query_pos)
        hs = self.decoder(tgt, memory, key_padding_mask, pos=pos, query_pos=query_pos)
        return hs, memory.transpose(1, 2).reshape(batch, channels, height, width)
