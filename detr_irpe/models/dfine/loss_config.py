"""The ``loss`` section of the D-FINE family: D-FINE's criterion and DEIM's.

``loss.classification`` picks the classification term: ``vfl`` (D-FINE: varifocal loss,
alpha 0.75, gamma 2) or ``mal`` (DEIM: matchability-aware loss, gamma 1.5, no alpha). The
other defaults are the published ones of both: L1 5, GIoU 2, FGL 0.15, DDF 1.5 (T = 5),
GO-LSD union matching on; matcher costs class 2 / L1 5 / GIoU 2 with the focal class cost
(alpha 0.25, gamma 2). ``check()`` raises a :class:`~detr_irpe.errors.ConfigError` naming
the key and the allowed values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from detr_irpe.config.schema import LossConfig
from detr_irpe.errors import ConfigError

# The classification terms: D-FINE's varifocal loss, DEIM's matchability-aware loss.
CLASSIFICATIONS = ("vfl", "mal")


def _number(key: str, value, low: float, high: float, *, open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (open_low and value == low):
        raise ConfigError(f"{key} must be a number in {'(' if open_low else '['}{low}, {high}], "
                          f"got {value!r}")


@dataclass
class DFINELossConfig(LossConfig):
    """Loss and matcher of D-FINE (``classification: vfl``) and DEIM (``mal``)."""

    FAMILY: ClassVar[str] = "dfine"

    # The classification term: "vfl" (D-FINE's varifocal loss) or "mal" (DEIM's
    # matchability-aware loss).
    classification: str = "vfl"
    # Weight of the classification term (loss_vfl or loss_mal).
    class_weight: float = 1.0
    # Weight of the L1 box loss.
    bbox_weight: float = 5.0
    # Weight of the generalised-IoU loss.
    giou_weight: float = 2.0
    # Weight of the fine-grained localization loss (FGL) on the edge distributions.
    fgl_weight: float = 0.15
    # Weight of the decoupled distillation focal loss (DDF) of each layer to the last.
    ddf_weight: float = 1.5
    # The FGL and DDF terms at all (false: classification and box terms only).
    local_losses: bool = True
    # Temperature of the DDF distillation.
    ddf_temperature: float = 5.0
    # Varifocal loss (classification=vfl): weight of the negatives.
    vfl_alpha: float = 0.75
    # Varifocal loss (classification=vfl): focusing exponent.
    vfl_gamma: float = 2.0
    # MAL (classification=mal): exponent of the IoU target and of the negatives' weight.
    mal_gamma: float = 1.5
    # MAL (classification=mal): factor of the negatives' weight; null: none (DEIM).
    mal_alpha: float | None = None
    # GO-LSD: the box, FGL and DDF terms use the union of the matches of every layer, the
    # first-layer boxes and the proposals (false: each output its own matches).
    use_uni_set: bool = True
    # Matching cost of the class score (focal).
    cost_class: float = 2.0
    # Matching cost of the L1 box distance.
    cost_bbox: float = 5.0
    # Matching cost of the negated generalised IoU.
    cost_giou: float = 2.0
    # Focal alpha of the matcher's class cost.
    focal_alpha: float = 0.25
    # Focal gamma of the matcher's class cost.
    focal_gamma: float = 2.0

    def __post_init__(self) -> None:
        self.check()

    def check(self, prefix: str = "loss") -> DFINELossConfig:
        """Raise :class:`ConfigError` naming ``<prefix>.<key>`` for a bad value; return self."""
        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        if self.classification not in CLASSIFICATIONS:
            raise ConfigError(f"{key('classification')} must be one of "
                              f"{', '.join(CLASSIFICATIONS)}, got {self.classification!r}")
        for name in ("class_weight", "bbox_weight", "giou_weight", "fgl_weight", "ddf_weight",
                     "cost_class", "cost_bbox", "cost_giou"):
            _number(key(name), getattr(self, name), 0.0, 1e6)
        for name in ("vfl_alpha", "focal_alpha"):
            _number(key(name), getattr(self, name), 0.0, 1.0)
        if self.mal_alpha is not None:
            _number(key("mal_alpha"), self.mal_alpha, 0.0, 1.0)
        for name in ("vfl_gamma", "mal_gamma", "focal_gamma"):
            _number(key(name), getattr(self, name), 0.0, 100.0)
        _number(key("ddf_temperature"), self.ddf_temperature, 0.0, 1e3, open_low=True)
        for name in ("local_losses", "use_uni_set"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{key(name)} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        if self.cost_class == self.cost_bbox == self.cost_giou == 0:
            raise ConfigError(f"{key('cost_class')}, {key('cost_bbox')} and {key('cost_giou')} "
                              "are all 0: the matching would be arbitrary")
        return self

    @classmethod
    def deim(cls, **overrides) -> DFINELossConfig:
        """DEIM's published loss (MAL, gamma 1.5), then ``overrides``."""
        return cls(**{"classification": "mal", **overrides})
