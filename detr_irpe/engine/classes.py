"""A run's class count: ``model.num_classes`` from the data (the largest category id + 1,
or the number of remapped categories), checked against an explicit one, and the warning
for a head most of whose outputs no category uses."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from detr_irpe.config import Config, ConfigError
from detr_irpe.data.coco import sparse_ids_warning

logger = logging.getLogger(__name__)


def with_num_classes(cfg: Config, num_classes: int,
                     category_ids: list[int] | None = None) -> Config:
    """``cfg`` with ``model.num_classes`` (and ``model.category_ids`` when given) set."""
    ids = cfg.model.category_ids if category_ids is None else list(category_ids)
    model = dataclasses.replace(cfg.model, num_classes=num_classes, category_ids=ids)
    return dataclasses.replace(cfg, model=model)


def warn_sparse_category_ids(datasets: list[Any], num_classes: int,
                             sigmoid: bool = False) -> None:
    """Log :func:`~detr_irpe.data.coco.sparse_ids_warning` for datasets trained on
    their category ids (not remapped) when most of the head's outputs are unused."""
    if any(d.category_ids is not None for d in datasets if d is not None):
        return
    ids = {int(i) for d in datasets if d is not None for i in d.category_names}
    message = sparse_ids_warning(ids, num_classes, sigmoid=sigmoid)
    if message:
        logger.warning("%s", message)


def resolve_num_classes(cfg: Config, datasets: list[Any]) -> int:
    """``model.num_classes`` from the data (largest category id + 1 over the splits, or
    the number of remapped categories).

    Raises:
        ConfigError: an explicit ``model.num_classes`` that differs from the data.
    """
    from_data = max((int(d.num_classes) for d in datasets if d is not None), default=None)
    explicit = cfg.model.num_classes
    if from_data is None:
        if explicit is None:
            raise ConfigError("cannot derive model.num_classes without a dataset: set it")
        return explicit
    if explicit is not None and explicit != from_data:
        remapped = any(getattr(d, "category_ids", None) is not None for d in datasets)
        what = (f"it has {from_data} categories (remapped to class indices)" if remapped else
                f"its largest category id is {from_data - 1}")
        raise ConfigError(
            f"model.num_classes={explicit} disagrees with the data: {what}, so num_classes "
            f"must be {from_data}; remove model.num_classes (it defaults to the data) or fix "
            "data.root / the annotation files"
        )
    return from_data


def with_data_classes(cfg: Config, datasets: list[Any]) -> Config:
    """``cfg`` with the class count and categories of the data; a class head refused as
    too big because a category id is large (not the number of categories) says that
    ``data.remap_categories=true`` is the fix, not a smaller ``model.num_classes``."""
    num_classes = resolve_num_classes(cfg, datasets)
    try:
        return with_num_classes(cfg, num_classes, datasets[0].category_ids)
    except ConfigError as err:
        ids = {int(i) for d in datasets if d is not None for i in d.category_names}
        remapped = any(d.category_ids is not None for d in datasets if d is not None)
        if remapped or not ids or not str(err).startswith("model.num_classes="):
            raise
        refused = str(err).removesuffix("; lower model.num_classes")
        raise ConfigError(
            f"{refused}. The class count is the largest category id + 1 ({max(ids)} + 1) while "
            f"the annotations have {len(ids)} categories: set data.remap_categories=true "
            f"for a {len(ids)}-class head (predictions keep the original ids)") from None


__all__ = [
    "resolve_num_classes",
    "warn_sparse_category_ids",
    "with_data_classes",
    "with_num_classes",
]
