"""Run a trained DETR on image files: detections as COCO-style JSON and drawn images.

Images are resized as at evaluation (shorter side ``data.val_size``, longer
side at most ``data.max_size``) and normalised with the ImageNet mean/std;
boxes come back in the original image's pixels.
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as F
from torch import Tensor, nn
from torchvision.utils import draw_bounding_boxes

from detr_irpe.config import Config

logger = logging.getLogger(__name__)

# Images smaller than this (shorter side) are drawn enlarged by an integer factor.
MIN_DRAW_SIZE = 320
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
_PALETTE = (
    "#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6",
    "#bfef45", "#fabed4", "#469990", "#dcbeff", "#9a6324", "#800000", "#aaffc3",
)


def collect_images(inputs: Iterable[str | Path]) -> list[Path]:
    """Files named by ``inputs``: image files, folders (their images, sorted) or globs.

    Raises:
        FileNotFoundError: an input matches nothing, or no image is found at all.
    """
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            matches = sorted(Path(m) for m in glob.glob(str(item), recursive=True))
            matches = [m for m in matches if m.is_file() and m.suffix.lower() in IMAGE_SUFFIXES]
            if not matches:
                raise FileNotFoundError(f"{item}: no such image file, folder or glob match")
            found += matches
    unique = list(dict.fromkeys(found))
    if not unique:
        raise FileNotFoundError(f"no images found in {', '.join(map(str, inputs))}")
    return unique


@dataclass
class Predictor:
    """A DETR in eval mode with its config, post-processor and category names."""

    model: nn.Module
    cfg: Config
    category_names: dict[int, str]
    device: torch.device

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | Path,
        config: str | Path | None = None,
        overrides: Sequence[str] = (),
        device: str = "auto",
    ) -> Predictor:
        """Load a checkpoint (own or public); its stored config unless ``config`` is given."""
        from detr_irpe.engine.distributed import resolve_device
        from detr_irpe.visualization.loading import load_model, resolve_category_names

        target = resolve_device(device)
        model, cfg, extra = load_model(config, checkpoint, overrides, device=target)
        names = resolve_category_names(cfg, extra) or {}
        return cls(model.eval(), cfg, dict(names), target)

    def preprocess(self, image: Tensor) -> Tensor:
        """``(3, H, W)`` uint8 -> the normalised, resized ``(3, h, w)`` float model input."""
        from detr_irpe.data.transforms import IMAGENET_MEAN, IMAGENET_STD, resized_hw

        height, width = image.shape[-2:]
        size = resized_hw(height, width, self.cfg.data.val_size, self.cfg.data.max_size)
        pixels = F.resize(image, list(size), antialias=True)
        pixels = F.to_dtype(pixels, torch.float32, scale=True)
        return F.normalize(pixels, mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD))

    @torch.no_grad()
    def __call__(self, images: Sequence[Tensor]) -> list[dict[str, Tensor]]:
        """Detections ``{"scores", "labels", "boxes"}`` (xyxy, original pixels) per uint8 image."""
        from detr_irpe.models import PostProcess

        inputs = [self.preprocess(image).to(self.device) for image in images]
        outputs = self.model(inputs)
        sizes = torch.tensor([list(image.shape[-2:]) for image in images], device=self.device)
        return [{k: v.cpu() for k, v in r.items()} for r in PostProcess()(outputs, sizes)]

    def label(self, category_id: int) -> str:
        return self.category_names.get(int(category_id), f"class {int(category_id)}")


def draw_detections(
    image: Tensor, detections: Mapping[str, Tensor], names: Mapping[int, str]
) -> Tensor:
    """``(3, H, W)`` uint8 image with boxes, ``name score`` labels and per-class colours
    (enlarged by an integer factor when its shorter side is below ``MIN_DRAW_SIZE``)."""
    boxes = detections["boxes"]
    # Small images are enlarged first so that the (fixed-size) label text stays readable.
    scale = max(1, -(-MIN_DRAW_SIZE // max(min(image.shape[-2:]), 1)))
    if scale > 1:
        image = F.resize(image, [image.shape[-2] * scale, image.shape[-1] * scale],
                         interpolation=F.InterpolationMode.NEAREST)
        boxes = boxes * scale
    if len(boxes) == 0:
        return image
    labels = [
        f"{names.get(int(c), f'class {int(c)}')} {float(s):.2f}"
        for c, s in zip(detections["labels"], detections["scores"])
    ]
    colors = [_PALETTE[int(c) % len(_PALETTE)] for c in detections["labels"]]
    width = max(1, round(min(image.shape[-2:]) / 150))
    return draw_bounding_boxes(image, boxes, labels=labels, colors=colors, width=width)


def predict_files(
    predictor: Predictor,
    files: Sequence[Path],
    output_dir: str | Path,
    *,
    score_threshold: float = 0.5,
    batch_size: int = 4,
    draw: bool = True,
    progress: bool = False,
) -> dict[str, Any]:
    """Detect objects in ``files``; write ``detections.json`` and (with ``draw``) one PNG
    per image into ``output_dir``.

    ``detections.json`` is a COCO results list (``image_id``, ``category_id``,
    ``bbox`` as ``[x, y, w, h]`` in original pixels, ``score``) whose entries
    also carry ``file_name`` and ``category_name``; ``image_id`` is the 1-based
    position of the file in ``files``.

    Returns:
        ``{"detections": [...], "images": [written PNG paths], "json": path}``.
    """
    from detr_irpe.data import read_image

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    written: list[Path] = []
    stems: dict[str, int] = {}
    batches = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
    iterator: Iterable = batches
    if progress:
        from tqdm import tqdm

        iterator = tqdm(batches, desc="predict", unit="batch", disable=None)
    for chunk_index, chunk in enumerate(iterator):
        images = [read_image(path) for path in chunk]
        detections = predictor(images)
        for offset, (path, image, det) in enumerate(zip(chunk, images, detections)):
            image_id = chunk_index * batch_size + offset + 1
            keep = det["scores"] >= score_threshold
            det = {k: v[keep] for k, v in det.items()}
            order = det["scores"].argsort(descending=True)
            det = {k: v[order] for k, v in det.items()}
            for box, label, score in zip(det["boxes"].tolist(), det["labels"].tolist(),
                                         det["scores"].tolist()):
                x1, y1, x2, y2 = box
                results.append({
                    "image_id": image_id,
                    "file_name": str(path),
                    "category_id": int(label),
                    "category_name": predictor.label(label),
                    "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                    "score": round(float(score), 5),
                })
            if draw:
                stem = path.stem
                count = stems.get(stem, 0)
                stems[stem] = count + 1
                name = f"{stem}.png" if count == 0 else f"{stem}_{count}.png"
                drawn = draw_detections(image, det, predictor.category_names)
                out = output_dir / name
                F.to_pil_image(drawn).save(out)
                written.append(out)
            logger.debug("%s: %d detections >= %.2f", path, len(det["scores"]), score_threshold)
    json_path = output_dir / "detections.json"
    # One detection per line: readable, and still one JSON list.
    json_path.write_text("[\n" + ",\n".join(json.dumps(r) for r in results) + "\n]\n")
    logger.info("%d images, %d detections (score >= %.2f) -> %s", len(files), len(results),
                score_threshold, output_dir)
    return {"detections": results, "images": written, "json": json_path}


__all__ = ["IMAGE_SUFFIXES", "Predictor", "collect_images", "draw_detections", "predict_files"]
