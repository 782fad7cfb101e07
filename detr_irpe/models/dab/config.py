"""The ``model`` and ``loss`` sections of the DAB-DETR family (DN-DETR with
``model.denoising.enabled``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from detr_irpe import sizes
from detr_irpe.config.checks import at_least, positive
from detr_irpe.config.estimates import refuse_if_too_big
from detr_irpe.errors import ConfigError
from detr_irpe.models.detr.config import SetLossConfig, TransformerDetectorConfig

__all__ = ["DABLossConfig", "DABModelConfig", "DenoisingConfig"]


@dataclass
class DenoisingConfig:
    """DN-DETR's denoising queries (training only)."""

    # Train with denoising queries (DN-DETR); off: DAB-DETR.
    enabled: bool = False
    # Noised copies of the ground truth per image (DN-DETR's "scalar").
    groups: int = 5
    # Probability that a copy's label is replaced by a uniformly drawn class.
    label_noise: float = 0.2
    # Box jitter: the centre moves up to box_noise * (w/2, h/2), the size up to box_noise * (w, h).
    box_noise: float = 0.4

    def __post_init__(self) -> None:
        positive("model.denoising.groups", self.groups)
        if not 0.0 <= self.label_noise <= 1.0:
            raise ConfigError(
                f"model.denoising.label_noise is a probability in [0, 1], got {self.label_noise!r}"
            )
        at_least("model.denoising.box_noise", self.box_noise, 0)


@dataclass
class DABModelConfig(TransformerDetectorConfig):
    """DAB-DETR (Liu et al., ICLR 2022): anchor-box queries, conditional cross-attention,
    sigmoid focal classes; DN-DETR (Li et al., CVPR 2022) with ``denoising.enabled``."""

    FAMILY: ClassVar[str] = "dab"
    PUBLISHED_PE_TEMPERATURE: ClassVar[float] = 20.0

    family: str = "dab"
    denoising: DenoisingConfig = field(default_factory=DenoisingConfig)
    # Detections kept per image by the post-processing: top (query, class) scores.
    num_select: int = 300

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("model.num_select", self.num_select)
        # The anchor's sine embedding gives each of x, y, w, h hidden_dim / 2 features in
        # sin / cos pairs, so hidden_dim / 2 must be even.
        if self.hidden_dim % 4:
            raise ConfigError(
                f"model.family=dab needs model.hidden_dim divisible by 4, got {self.hidden_dim}"
            )

    def check_data_sizes(self, objects_per_image: int = 1, where: str = "") -> None:
        """Refuse denoising sizes whose decoder self-attention mask cannot be allocated.

        DN-DETR adds ``denoising.groups`` copies of each image's ground truth to the
        ``num_queries`` matching queries, and the decoder's mask is square in their sum
        (:func:`detr_irpe.sizes.denoising_mask_bytes`). The config alone gives one object
        per image (a lower bound); the training run checks again with
        ``objects_per_image`` of its data, ``where`` saying where they are.
        """
        if not self.denoising.enabled:
            return
        values = {"model.denoising.groups": self.denoising.groups,
                  "model.num_queries": self.num_queries}
        defaults = {"model.denoising.groups": DenoisingConfig().groups,
                    "model.num_queries": DABModelConfig.num_queries}

        def mask(v: Mapping[str, int]) -> int:
            return sizes.denoising_mask_bytes(
                num_queries=v["model.num_queries"], groups=v["model.denoising.groups"],
                objects_per_image=objects_per_image)

        objects = f"{objects_per_image} object(s) {where or 'per image at least'}"
        refuse_if_too_big(mask, values, defaults, values,
                          f"the denoising attention mask ((num_queries + groups x "
                          f"{objects_per_image})^2 bools, {objects})")


@dataclass
class DABLossConfig(SetLossConfig):
    FAMILY: ClassVar[str] = "dab"

    # Weight of the positives in the sigmoid focal loss and focal matching cost
    # (RetinaNet's alpha).
    focal_alpha: float = 0.25
    # Focusing exponent of the focal loss and matching cost (RetinaNet's gamma).
    focal_gamma: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.focal_alpha > 1:
            raise ConfigError(
                f"loss.focal_alpha weighs positives against negatives, in [0, 1]; got "
                f"{self.focal_alpha!r}"
            )
