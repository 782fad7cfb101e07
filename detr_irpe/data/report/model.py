"""What the data report needs to know of the model a config builds: its class head and
the strides it detects at. The only part of the report that reads a config (a builder);
the family registry answers every family question."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from detr_irpe.config import Config
from detr_irpe.errors import DetrIrpeError
from detr_irpe.family import families, get_family

__all__ = ["ModelView", "model_view"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelView:
    """A model's class head and detection strides, as the data report sees them.

    Attributes:
        family: ``model.family``.
        name: the configuration's name (``"DN-DAB-DETR"``).
        sigmoid_classes: one sigmoid per class (no "no object" output), not a softmax
            with a "no object" output after the classes.
        num_classes: ``model.num_classes`` as configured (None: from the data).
        category_ids: ``model.category_ids`` (class index -> category id), or None.
        remap_categories: ``data.remap_categories``.
        strides: input pixels per cell of each map it detects from, finest first.
        finer_hint: a setting of this family with a finer stride, or None.
        finer_families: ``(family, its default strides)`` of the families whose default
            configuration detects at a finer stride than ``strides[0]``.
    """

    family: str
    name: str
    sigmoid_classes: bool
    num_classes: int | None
    category_ids: tuple[int, ...] | None
    remap_categories: bool
    strides: tuple[int, ...]
    finer_hint: str | None = None
    finer_families: tuple[tuple[str, tuple[int, ...]], ...] = ()


def _finer_families(than: int, own: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for family in families():
        if family.name == own:
            continue
        try:
            strides = tuple(family.model_config().detection_strides())
        except (DetrIrpeError, TypeError, ValueError) as err:  # a user's family may need keys
            logger.debug("no default strides of family %s: %s", family.name, err)
            continue
        if strides and min(strides) < than:
            out.append((family.name, strides))
    return tuple(out)


def model_view(cfg: Config) -> ModelView:
    """The :class:`ModelView` of ``cfg``'s model and data sections."""
    model = cfg.model
    family = get_family(model.family)
    strides = tuple(sorted(model.detection_strides()))
    return ModelView(
        family=family.name, name=family.name_of(model), sigmoid_classes=family.sigmoid_classes,
        num_classes=model.num_classes,
        category_ids=None if model.category_ids is None else tuple(model.category_ids),
        remap_categories=cfg.data.remap_categories, strides=strides,
        finer_hint=model.finer_stride_hint(),
        finer_families=_finer_families(strides[0], family.name))
