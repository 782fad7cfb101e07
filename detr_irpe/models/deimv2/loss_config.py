"""The ``loss`` section of the DEIMv2 family: DEIM's criterion (D-FINE's with the
matchability-aware loss; :class:`~detr_irpe.models.dfine.loss_config.DFINELossConfig`'s
keys and checks) and DEIMv2's matcher switch.

From epoch ``matcher_change_epoch`` on, the matcher's cost is ``-(p * IoU ** alpha)``
(:class:`~detr_irpe.models.deimv2.matching.DEIMv2Matcher`, ``alpha`` =
``iou_order_alpha``, 4 published); the published switch epochs are S 100, M 80, L 50,
X 45. The criterion's matcher holds the epoch (``set_epoch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from detr_irpe.errors import ConfigError
from detr_irpe.models.dfine.loss_config import DFINELossConfig, _number

MAX_EPOCH = 1_000_000


@dataclass
class DEIMv2LossConfig(DFINELossConfig):
    """DEIM's loss (``classification: mal``) and the matcher switch (module docstring)."""

    FAMILY: ClassVar[str] = "deimv2"

    classification: str = "mal"
    # The first epoch (0-based) whose matching uses the cost -(p * IoU ** iou_order_alpha)
    # instead of the focal / L1 / GIoU cost; null: never.
    matcher_change_epoch: int | None = None
    # The IoU's exponent in the matching cost from matcher_change_epoch on (4).
    iou_order_alpha: float = 4.0

    def check(self, prefix: str = "loss") -> DEIMv2LossConfig:
        super().check(prefix)
        epoch = self.matcher_change_epoch
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)
                                  or not 0 <= epoch <= MAX_EPOCH):
            raise ConfigError(f"{prefix}.matcher_change_epoch must be an integer in "
                              f"[0, {MAX_EPOCH}] or null, got {epoch!r}")
        _number(f"{prefix}.iou_order_alpha", self.iou_order_alpha, 0.0, 100.0, open_low=True)
        return self
