"""Model outputs -> per-image detections in absolute pixel coordinates.

- :class:`PostProcess` (DETR): softmax, the best real class of every query.
- :class:`TopKPostProcess` (DAB-DETR / DN-DETR, sigmoid classification): the
  ``num_select`` best (query, class) pairs of each image, so one query may give
  several detections of different classes.

Both return category ids: a model trained on remapped categories
(``data.remap_categories``) gives them its ``model.category_ids``, and class index
``k`` comes out as category ``category_ids[k]``. :class:`TopKPostProcess` scores only
the classes that are categories when it is told which exist (``categories``): a head of
``largest id + 1`` outputs on ids starting at 1 has an output 0 that is no category, and
COCO's 91 outputs hold 11 ids that are none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy


def _absolute_xyxy(outputs: dict, target_sizes: Tensor) -> Tensor:
    """``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1] -> absolute xyxy float32 for the
    ``(B, 2)`` ``[height, width]`` ``target_sizes`` (checked against the batch)."""
    boxes = outputs["pred_boxes"]
    if len(boxes) != len(target_sizes):
        raise ValueError(f"{len(boxes)} predictions but {len(target_sizes)} target sizes")
    if target_sizes.dim() != 2 or target_sizes.shape[1] != 2:
        raise ValueError(f"target_sizes must be (B, 2) [h, w], got {tuple(target_sizes.shape)}")
    height, width = target_sizes.float().unbind(1)
    scale = torch.stack((width, height, width, height), dim=1).to(boxes.device)
    return box_cxcywh_to_xyxy(boxes.float()) * scale[:, None, :]


class _CategoryIds(nn.Module):
    """Class index -> category id (``model.category_ids``; None: the same number)."""

    def __init__(self, category_ids: Sequence[int] | None = None) -> None:
        super().__init__()
        ids = None if category_ids is None else torch.tensor(list(category_ids), dtype=torch.int64)
        # not saved: the mapping is the config's (model.category_ids), not a weight
        self.register_buffer("category_ids", ids, persistent=False)

    def category_of(self, labels: Tensor) -> Tensor:
        """The category ids of class indices ``labels`` (any shape, int64)."""
        if self.category_ids is None:
            return labels
        return self.category_ids.to(labels.device)[labels]


class PostProcess(_CategoryIds):
    """Softmax, drop "no object", keep the best class of every query; boxes to absolute xyxy.

    Args:
        category_ids: the category id of each class index (``model.category_ids``);
            None: labels are the class indices.
    """

    @torch.no_grad()
    def forward(self, outputs: dict, target_sizes: Tensor) -> list[dict[str, Tensor]]:
        """
        Args:
            outputs: ``pred_logits`` ``(B, Q, C + 1)``, ``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1].
            target_sizes: ``(B, 2)`` ``[height, width]`` of each original image.

        Returns:
            B dicts: ``scores`` ``(Q,)``, ``labels`` ``(Q,)`` int64 category ids,
            ``boxes`` ``(Q, 4)`` absolute (x1, y1, x2, y2) float32.
        """
        xyxy = _absolute_xyxy(outputs, target_sizes)
        prob = outputs["pred_logits"].float().softmax(-1)
        scores, labels = prob[..., :-1].max(-1)
        labels = self.category_of(labels)
        return [{"scores": s, "labels": lab, "boxes": b} for s, lab, b in zip(scores, labels, xyxy)]


class TopKPostProcess(_CategoryIds):
    """Sigmoid scores of every (query, class) pair; the ``num_select`` best of each image.

    Args:
        num_select: detections kept per image (DAB-DETR / DN-DETR: 300); fewer when
            the model has fewer than ``num_select`` (query, class) pairs.
        category_ids: as for :class:`PostProcess`.
        categories: the category ids that exist (a dataset's, a checkpoint's); only the
            class outputs that are one of them are scored. None: every output.
    """

    def __init__(self, num_select: int = 300, category_ids: Sequence[int] | None = None,
                 categories: Iterable[int] | None = None) -> None:
        super().__init__(category_ids)
        if num_select < 1:
            raise ValueError(f"num_select must be at least 1, got {num_select}")
        self.num_select = num_select
        classes = None
        if categories is not None:
            known = {int(c) for c in categories}
            ids = range(max(known, default=-1) + 1) if category_ids is None else category_ids
            classes = torch.tensor([k for k, c in enumerate(ids) if int(c) in known],
                                   dtype=torch.int64)
        # the class indices scored (not saved: the categories are the data's, not weights)
        self.register_buffer("classes", classes, persistent=False)

    @torch.no_grad()
    def forward(self, outputs: dict, target_sizes: Tensor) -> list[dict[str, Tensor]]:
        """
        Args:
            outputs: ``pred_logits`` ``(B, Q, C)`` (sigmoid logits, no "no object"
                column), ``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1].
            target_sizes: ``(B, 2)`` ``[height, width]`` of each original image.

        Returns:
            B dicts, highest score first: ``scores`` ``(K,)`` float32, ``labels`` ``(K,)``
            int64 category ids, ``boxes`` ``(K, 4)`` absolute (x1, y1, x2, y2) float32, with
            ``K = min(num_select, Q * C)``, ``C`` the classes scored. Pair ``i * C + c`` is
            query ``i``, scored class ``c``.
        """
        xyxy = _absolute_xyxy(outputs, target_sizes)  # (B, Q, 4)
        logits = outputs["pred_logits"]
        classes = self.classes
        if classes is not None:  # the outputs that are categories, C of them
            classes = classes[classes < logits.shape[-1]].to(logits.device)
            logits = logits.index_select(-1, classes)
        batch, num_queries, num_classes = logits.shape
        # Explicit sizes: reshape cannot infer a -1 when B = 0.
        prob = logits.float().sigmoid().reshape(batch, num_queries * num_classes)
        scores, pairs = prob.topk(min(self.num_select, prob.shape[1]), dim=1)
        # max(C, 1): with C = 0 there is no pair, but the division is still traced.
        queries = torch.div(pairs, max(num_classes, 1), rounding_mode="floor")
        index = pairs - queries * num_classes
        labels = self.category_of(index if classes is None else classes[index])
        boxes = xyxy.gather(1, queries[..., None].expand(-1, -1, 4))
        return [{"scores": s, "labels": lab, "boxes": b} for s, lab, b in zip(scores, labels, boxes)]
