"""The ``model`` and ``loss`` sections of the DAB-DETR family (DN-DETR with
``model.denoising.enabled``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from detr_irpe.config.checks import at_least, positive
from detr_irpe.errors import ConfigError
from detr_irpe.models.detr.config import SetLossConfig, TransformerDetectorConfig

__all__ = ["MAX_DENOISING_QUERIES", "DABLossConfig", "DABModelConfig", "DenoisingConfig"]

# Denoising queries per image at most (groups x objects of the most crowded image): the
# (queries + denoising queries)^2 attention mask of every decoder layer grows with it.
# COCO's most crowded image has 93 objects; DN-DETR uses 5 groups (465 queries).
MAX_DENOISING_QUERIES = 100_000
# Objects per image the bound above assumes (COCO's most crowded training image: 93).
_OBJECTS_PER_IMAGE = 100


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

    def bounded_sizes(self) -> dict[str, tuple[int, int]]:
        if not self.denoising.enabled:
            return {}
        return {"model.denoising.groups": (
            self.denoising.groups, MAX_DENOISING_QUERIES // _OBJECTS_PER_IMAGE)}


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
