"""Predictions where practitioners use them: a :class:`~detr_irpe.inference.Predictor`
result as ``supervision.Detections`` (the ``formats`` extra: its annotators, trackers,
zones and metrics take them) and as COCO results JSON (what ``pycocotools``'
``COCO.loadRes``, evaluation servers and most tools read).

::

    from detr_irpe import Predictor
    from detr_irpe.inference.interop import as_supervision, write_coco_results

    predictor = Predictor.from_checkpoint("outputs/run/checkpoint_best.pth")
    results = predictor(["a.jpg", "b.jpg"], score_threshold=0.3)
    detections = as_supervision(results[0])          # sv.Detections of a.jpg
    write_coco_results("results.json", results, image_ids=[1, 2])

A result is the dict :meth:`Predictor.__call__` returns for one image: ``boxes`` ``(K, 4)``
xyxy in the image's pixels, ``scores`` ``(K,)``, ``labels`` ``(K,)`` category ids and
``label_names``.
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


def as_supervision(result: Mapping[str, Any]) -> Any:
    """One image's result as ``supervision.Detections``: ``xyxy`` ``(K, 4)`` float32 in
    the image's pixels, ``confidence`` ``(K,)``, ``class_id`` ``(K,)`` the category ids,
    and ``data["class_name"]`` the names (what supervision's label annotator shows).

    Raises:
        ConfigError: supervision is not installed (the ``formats`` extra).
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
    names = result.get("label_names")
    data = {} if names is None else {"class_name": np.asarray(list(names), dtype=str)}
    return supervision.Detections(xyxy=boxes, confidence=scores, class_id=labels, data=data)


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
