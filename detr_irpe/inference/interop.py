"""Predictions where practitioners use them: a :class:`~detr_irpe.inference.Predictor`
result as ``supervision.Detections`` (the ``formats`` extra: its annotators, trackers,
zones and metrics take them) and as COCO results JSON (what ``pycocotools``'
``COCO.loadRes``, evaluation servers and most tools read).

::

    from detr_irpe import Predictor
    from detr_irpe.inference.interop import as_supervision, write_coco_results

    predictor = Predictor.from_checkpoint("outputs/run/checkpoint_best.pth")
    results = predictor(["a.jpg", "b.jpg"], score_threshold=0.3)
    detections = as_supervision(results[0], predictor.category_names)  # sv.Detections
    write_coco_results("results.json", results, image_ids=[1, 2])

A result is the dict :meth:`Predictor.__call__` returns for one image: ``boxes`` ``(K, 4)``
xyxy in the image's pixels, ``scores`` ``(K,)``, ``labels`` ``(K,)`` category ids and
``label_names``.

supervision numbers classes ``0..K-1`` (``DetectionDataset.from_yolo`` loads a YOLO
folder's class ``k`` as ``class_id`` ``k``; ``from_coco`` numbers the categories in
order), while this package's models predict category ids (``detr-irpe-data convert``
writes YOLO class ``k`` as category id ``k + 1``). :func:`as_supervision` therefore gives
``class_id`` as the category's index among the dataset's categories and keeps the id in
``data["category_id"]``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from detr_irpe.errors import ConfigError
from detr_irpe.utils.files import atomic_write_text

__all__ = ["as_coco_results", "as_supervision", "write_coco_results"]


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _arrays(result: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    boxes = _numpy(result["boxes"]).reshape(-1, 4).astype(np.float32)
    scores = _numpy(result["scores"]).reshape(-1).astype(np.float32)
    labels = _numpy(result["labels"]).reshape(-1).astype(np.int64)
    if not len(boxes) == len(scores) == len(labels):
        raise ValueError(f"boxes, scores and labels differ in length ({len(boxes)}, "
                         f"{len(scores)}, {len(labels)})")
    return boxes, scores, labels


def _class_indices(labels: np.ndarray, categories: Mapping[int, Any] | Sequence[int] | None
                   ) -> np.ndarray:
    """The 0-based index of each category id in ``categories`` (their order), or, without
    categories, ``id - 1`` (the numbering ``detr-irpe-data convert`` writes: 1..K)."""
    if categories is None or len(categories) == 0:
        if len(labels) and int(labels.min()) < 1:
            raise ValueError(
                f"category id {int(labels.min())} has no 0-based index without the dataset's "
                "categories: pass them, e.g. as_supervision(result, predictor.category_names)")
        return labels - 1
    ids = [int(c) for c in categories]
    if len(set(ids)) != len(ids):
        raise ValueError(f"categories hold a category id twice: {ids}")
    index = {c: k for k, c in enumerate(ids)}
    missing = sorted({int(c) for c in labels.tolist()} - set(index))
    if missing:
        raise ValueError(f"category id {missing[0]} is not among the {len(ids)} categories "
                         f"given ({ids[:10]}{' ...' if len(ids) > 10 else ''})")
    return np.asarray([index[int(c)] for c in labels.tolist()], dtype=np.int64)


def as_supervision(result: Mapping[str, Any],
                   categories: Mapping[int, Any] | Sequence[int] | None = None) -> Any:
    """One image's result as ``supervision.Detections``: ``xyxy`` ``(K, 4)`` float32 in
    the image's pixels, ``confidence`` ``(K,)``, ``class_id`` ``(K,)`` the 0-based class
    index supervision's datasets and metrics use, ``data["category_id"]`` the category ids
    and ``data["class_name"]`` the names (what supervision's label annotator shows).

    Args:
        result: one image's result of :meth:`Predictor.__call__`.
        categories: the dataset's category ids in its order (``class_id`` ``k`` is the
            ``k``-th), or a mapping whose keys are (``predictor.category_names``, a COCO
            file's ``{id: name}``). None (or empty): ``class_id = category id - 1``, the
            numbering of a dataset ``detr-irpe-data convert`` wrote (ids 1..K in the
            YOLO / VOC class order).

    Raises:
        ConfigError: supervision is not installed (the ``formats`` extra).
        ValueError: a category id that is not among ``categories`` (or below 1 without them).
    """
    try:
        # optional: the formats extra (setup.cfg)
        with warnings.catch_warnings():  # its note that OpenCV is absent (none is needed)
            warnings.simplefilter("ignore", UserWarning)
            import supervision
    except ImportError:
        raise ConfigError("as_supervision needs the supervision package: pip install "
                          "'detr_irpe[formats]' (or pip install supervision)") from None
    boxes, scores, labels = _arrays(result)
    data: dict[str, np.ndarray] = {"category_id": labels}
    names = result.get("label_names")
    if names is not None:
        data["class_name"] = np.asarray(list(names), dtype=str).reshape(-1)
    return supervision.Detections(xyxy=boxes, confidence=scores,
                                  class_id=_class_indices(labels, categories), data=data)


def as_coco_results(results: Sequence[Mapping[str, Any]], image_ids: Sequence[int]
                    ) -> list[dict[str, Any]]:
    """COCO results entries (``image_id``, ``category_id``, ``bbox`` ``[x, y, w, h]``,
    ``score``) of one result per image, ``image_ids[i]`` being the id of image ``i``."""
    if len(results) != len(image_ids):
        raise ValueError(f"{len(results)} results but {len(image_ids)} image ids")
    entries = []
    for image_id, result in zip(image_ids, results):
        boxes, scores, labels = _arrays(result)
        for (x1, y1, x2, y2), score, label in zip(boxes.tolist(), scores.tolist(),
                                                  labels.tolist()):
            entries.append({"image_id": int(image_id), "category_id": int(label),
                            "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2),
                                     round(y2 - y1, 2)],
                            "score": round(float(score), 5)})
    return entries


def write_coco_results(path: str | Path, results: Sequence[Mapping[str, Any]],
                       image_ids: Sequence[int]) -> Path:
    """Write :func:`as_coco_results` to ``path`` as JSON (atomically)."""
    return atomic_write_text(path, json.dumps(as_coco_results(results, image_ids)))
