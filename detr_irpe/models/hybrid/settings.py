"""The settings of a hybrid-encoder family's decoder (query selection, deformable
decoder layers, contrastive denoising), one object instead of a constructor's score of
arguments; a family's decoder that needs more extends :class:`DecoderSettings`
(D-FINE: :class:`~detr_irpe.models.dfine.decoder.DFINEDecoderSettings`). Built from the
config by :meth:`~detr_irpe.models.hybrid.config.HybridModelConfig.decoder_settings`;
the defaults are RT-DETR R50's.
"""

from __future__ import annotations

from dataclasses import dataclass

# The absolute encodings of the AIFI layer: the 2D sin-cos encoding (published) or none.
POSITION_EMBEDDINGS = ("sine", "none")


@dataclass(frozen=True)
class DenoisingSettings:
    """Contrastive denoising in training
    (:func:`~detr_irpe.models.hybrid.denoising.contrastive_denoising`)."""

    # the query budget: G = max(num_denoising // N, 1) groups of N positives and N negatives
    num_denoising: int = 100
    # the probability that a query's label is flipped is label_noise / 2
    label_noise: float = 0.5
    # the corners move by up to box_noise * (w or h) / 2 (negatives: twice that)
    box_noise: float = 1.0
    # a noisy box's negative width / height made positive (D-FINE), else kept (RT-DETR)
    abs_sizes: bool = False


@dataclass(frozen=True)
class DecoderSettings:
    """What a hybrid-encoder family's decoder is built from.

    Attributes:
        num_classes: C (sigmoid logits, no "no object" column).
        hidden_dim, nhead, dim_feedforward, dropout: of the decoder layers.
        num_queries: Q, the selected proposals.
        feat_channels: channels of the encoder's maps, finest first.
        num_levels: memory levels; extra levels beyond the encoder's maps come from 3x3 / 2
            convolutions.
        num_points: sampling points per head of the deformable attention: one count for
            every level, or one per level.
        num_layers: decoder layers.
        num_denoising, label_noise, box_noise: contrastive denoising in training
            (``num_denoising=0``: off, and no ``denoising_class_embed``).
        eval_idx: the layer whose output is the eval-time prediction (-1: the last).
        eps: anchor validity margin.
        aux_loss: training outputs of every layer and of the proposals.
    """

    num_classes: int = 80
    hidden_dim: int = 256
    num_queries: int = 300
    feat_channels: tuple[int, ...] = (256, 256, 256)
    num_levels: int = 3
    num_points: int | tuple[int, ...] = 4
    nhead: int = 8
    num_layers: int = 6
    dim_feedforward: int = 1024
    dropout: float = 0.0
    num_denoising: int = 100
    label_noise: float = 0.5
    box_noise: float = 1.0
    eval_idx: int = -1
    eps: float = 1e-2
    aux_loss: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "feat_channels", tuple(self.feat_channels))
        if not isinstance(self.num_points, int):
            object.__setattr__(self, "num_points", tuple(self.num_points))
        if len(self.feat_channels) > self.num_levels:
            raise ValueError(f"{len(self.feat_channels)} encoder maps for {self.num_levels} "
                             "levels")
        if not isinstance(self.num_points, int) and len(self.num_points) != self.num_levels:
            raise ValueError(f"num_points {self.num_points} must give the points of each of "
                             f"the {self.num_levels} levels")
        if not -self.num_layers <= self.eval_idx < self.num_layers:
            raise ValueError(f"eval_idx {self.eval_idx} outside the {self.num_layers} decoder "
                             "layers")

    def mlp_activation(self) -> str:
        """The activation of the MLP heads (ReLU; a family's settings may choose)."""
        return "relu"

    def denoising(self, abs_sizes: bool = False) -> DenoisingSettings:
        """The denoising part of these settings."""
        return DenoisingSettings(self.num_denoising, self.label_noise, self.box_noise,
                                 abs_sizes)
