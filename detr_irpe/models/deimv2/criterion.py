"""DEIMv2's criterion: D-FINE / DEIM's (:class:`~detr_irpe.models.dfine.criterion.
DFINECriterion`, built by :func:`detr_irpe.models.dfine.criterion.build_criterion`) whose
matcher is :class:`~detr_irpe.models.deimv2.matching.DEIMv2Matcher`, which switches to
the IoU-order cost at ``loss.matcher_change_epoch``.

The published criterion receives the epoch at each call (``criterion(outputs, targets,
epoch=...)``, handed on to its matcher); here the training loop tells the criterion the
epoch once, before each epoch's first step (:meth:`DEIMv2Criterion.set_epoch`, the hook
:func:`detr_irpe.engine.trainer.train_one_epoch` calls on any criterion that has it), and
the criterion is called as every other family's. A criterion built and never told an
epoch matches as at epoch 0.
"""

from __future__ import annotations

import logging

from detr_irpe.models.deimv2.loss_config import DEIMv2LossConfig
from detr_irpe.models.deimv2.matching import DEIMv2Matcher
from detr_irpe.models.dfine.criterion import DFINECriterion
from detr_irpe.models.dfine.criterion import build_criterion as build_dfine_criterion

logger = logging.getLogger(__name__)


class DEIMv2Criterion(DFINECriterion):
    """:class:`DFINECriterion` with a :class:`DEIMv2Matcher` and the epoch hook."""

    matcher: DEIMv2Matcher
    _told = False  # set_epoch was called

    def set_epoch(self, epoch: int) -> None:
        """The epoch (0-based) of the next calls: the matcher's cost follows it. Logs the
        cost an epoch starts with when it differs from the last epoch's (or at the
        first call, when it is the IoU-order cost: a resumed run past the switch)."""
        before = self.matcher.iou_order if self._told else False
        self.matcher.set_epoch(epoch)
        self._told = True
        if self.matcher.iou_order != before:
            logger.info("epoch %d: the matcher's cost is %s", epoch,
                        f"-(p * IoU ** {self.matcher.iou_order_alpha:g}) (DEIMv2's switch at "
                        f"epoch {self.matcher.change_epoch})" if self.matcher.iou_order
                        else "D-FINE's (class, L1, GIoU)")

    @property
    def epoch(self) -> int:
        """The epoch the matcher was last told."""
        return self.matcher.epoch


def build_criterion(model_cfg, loss_cfg: DEIMv2LossConfig) -> DEIMv2Criterion:
    """The criterion of ``loss_cfg`` for a model of ``model_cfg`` (D-FINE's weights and
    settings); its matcher is a :class:`DEIMv2Matcher` (epoch 0 until
    :meth:`DEIMv2Criterion.set_epoch` is called)."""
    dfine = build_dfine_criterion(model_cfg, loss_cfg)
    matcher = DEIMv2Matcher(
        loss_cfg.cost_class, loss_cfg.cost_bbox, loss_cfg.cost_giou, loss_cfg.focal_alpha,
        loss_cfg.focal_gamma, change_epoch=loss_cfg.matcher_change_epoch,
        iou_order_alpha=loss_cfg.iou_order_alpha)
    return DEIMv2Criterion(
        matcher, dfine.weight_dict, dfine.classification, vfl_alpha=dfine.vfl_alpha,
        vfl_gamma=dfine.vfl_gamma, mal_gamma=dfine.mal_gamma, mal_alpha=dfine.mal_alpha,
        local_losses=dfine.local_losses, use_uni_set=dfine.use_uni_set,
        ddf_temperature=dfine.ddf_temperature)
