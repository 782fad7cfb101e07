"""Detect objects from Python: a trained DETR behind one call.

::

    from detr_irpe import Predictor

    predictor = Predictor.from_checkpoint("outputs/demo/checkpoint_best.pth")
    result = predictor("photo.jpg")            # or a PIL image, an array, a tensor, a list
    for box, name, score in zip(result["boxes"], result["label_names"], result["scores"]):
        print(name, float(score), box.tolist())   # xyxy in the input's pixels

Images are resized as at evaluation (shorter side ``data.val_size``, longer side
about ``data.max_size``, the resize rule of :mod:`detr_irpe.data.transforms`) and
normalised with the ImageNet mean / std; boxes come back in the pixels of the
image that was passed in, cut to it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.config import Config
from detr_irpe.data.categories import default_category_names
from detr_irpe.data.images import to_uint8_image
from detr_irpe.data.transforms import eval_image
from detr_irpe.inference.runtime import build_runtime, trace_size_for
from detr_irpe.models import build_postprocessor, model_from_checkpoint
from detr_irpe.models.box_ops import clip_boxes_to_image
from detr_irpe.utils.device import resolve_device

logger = logging.getLogger(__name__)

# What one image may be: a file, a PIL image, an (H, W, 3) uint8 array, or a (3, H, W)
# tensor (uint8, or float in [0, 1]).
ImageInput = str | Path | Image.Image | np.ndarray | Tensor


class Predictor:
    """A DETR (or DAB-DETR / DN-DETR) in eval mode with its config and category names.

    Args:
        model: the detector (its weights loaded).
        cfg: its config; ``data.val_size`` / ``data.max_size`` set the input size.
        category_names: ``{category id: name}``; ids without a name show as ``class N``.
        device: where the model runs (None: the GPU when there is one).
        score_threshold: detections with a lower score are left out.
        postprocessor: outputs -> per-image detections; None: the one of ``cfg``'s
            decoder (DETR's softmax, or the dab decoder's top ``model.num_select``
            (query, class) sigmoid scores).
        runtime: what the forward pass runs in (:mod:`detr_irpe.inference.runtime`):
            ``pytorch`` (the model as it is), ``fused`` (its inference form: folded batch
            norms, merged RepVGG blocks; the same outputs to float32 rounding, faster on
            the CPU), ``compiled`` (the fused form through ``torch.compile``, once per
            input size; the fused form where no compiler is) or ``onnxruntime`` (exported
            once per model and settings at the config's evaluation size and cached,
            checked against PyTorch on the first image; the ``onnx`` extra, CPU).
            Post-processing is the same.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: Config,
        category_names: Mapping[int, str] | None = None,
        device: str | torch.device | None = None,
        score_threshold: float = 0.7,
        postprocessor: nn.Module | None = None,
        runtime: str = "pytorch",
    ) -> None:
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.runtime = runtime
        # what detect() runs: the model itself, its inference form, or ONNX Runtime (its
        # graph traced at the size the config evaluates at, where that is one size)
        self._infer = build_runtime(runtime, self.model, device=self.device,
                                    trace_size=trace_size_for(cfg))
        self.cfg = cfg
        self.category_names = {int(k): str(v) for k, v in (category_names or {}).items()}
        self.score_threshold = float(score_threshold)
        self.postprocessor = postprocessor if postprocessor is not None else (
            build_postprocessor(cfg))

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        score_threshold: float = 0.7,
        config: str | Path | Config | None = None,
        overrides: Sequence[str] = (),
        trust_imports: bool = False,
        runtime: str = "pytorch",
    ) -> Predictor:
        """Load any checkpoint :func:`detr_irpe.models.model_from_checkpoint` reads, or a
        published one by name (``"detr_r50"``, docs/checkpoints.md) or http(s) address,
        downloaded once into torch.hub's cache.

        The config saved in the file is used unless ``config`` is given (public
        DETR / iRPE-DETR files need one, e.g. ``config="detr_r50"``; a published name
        brings its own); ``overrides`` are ``"section.key=value"`` strings. Category
        names come from the file, else COCO's for a 91-class model. Modules the saved
        config names (``model.import``) are imported only with ``trust_imports`` (or when
        ``overrides`` set ``model.import``): loading a checkpoint runs no code it names.
        ``runtime``: ``pytorch``, ``fused``, ``compiled`` or ``onnxruntime``
        (:mod:`detr_irpe.inference.runtime`).
        """
        target = resolve_device(device)
        source = resolve_checkpoint(path)
        if config is None:
            config = source.config
        loaded = model_from_checkpoint(source.path, config=config, overrides=overrides,
                                       device=target, trust_imports=trust_imports)
        names = loaded.category_names or default_category_names(loaded.cfg.model.num_classes)
        postprocessor = loaded.postprocessor
        if not loaded.category_names and names:  # a COCO model: only COCO's 80 categories
            postprocessor = build_postprocessor(loaded.cfg, categories=names)
        return cls(loaded.model, loaded.cfg, names, target, score_threshold, postprocessor,
                   runtime=runtime)

    def label(self, category_id: int) -> str:
        """The name of a category id (``class N`` when it has none)."""
        return self.category_names.get(int(category_id), f"class {int(category_id)}")

    def preprocess(self, image: Tensor) -> Tensor:
        """``(3, H, W)`` uint8 -> the normalised, resized ``(3, h, w)`` float model input."""
        return eval_image(image, self.cfg.data)

    @torch.no_grad()
    def detect(self, images: Sequence[Tensor]) -> list[dict[str, Tensor]]:
        """Every detection, sorted by score, for ``(3, H, W)`` uint8 images (one batch):
        one per query (DETR), or the top ``model.num_select`` (query, class) pairs (dab
        decoder).

        Returns per image ``{"scores" (K,), "labels" (K,) int64, "boxes" (K, 4)}`` on
        the CPU, boxes xyxy in that image's pixels, cut to the image (the model may
        place a box edge outside it).
        """
        if not images:
            return []
        inputs = [self.preprocess(image).to(self.device) for image in images]
        outputs = self._infer(inputs)
        sizes = torch.tensor([list(image.shape[-2:]) for image in images], device=self.device)
        results = []
        for image, result in zip(images, self.postprocessor(outputs, sizes)):
            order = result["scores"].argsort(descending=True)
            result = {key: value[order].cpu() for key, value in result.items()}
            result["boxes"] = clip_boxes_to_image(result["boxes"], *image.shape[-2:])
            results.append(result)
        return results

    def _kept(self, detections: Mapping[str, Tensor], threshold: float) -> dict[str, Any]:
        keep = detections["scores"] >= threshold
        out: dict[str, Any] = {key: value[keep] for key, value in detections.items()}
        out["label_names"] = [self.label(int(c)) for c in out["labels"]]
        return out

    def __call__(
        self,
        images: ImageInput | Sequence[ImageInput],
        score_threshold: float | None = None,
        batch_size: int = 4,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Detections of one image (a dict) or of a list of images (a list of dicts).

        Each dict holds ``boxes`` ``(K, 4)`` xyxy in the input's pixels, ``scores``
        ``(K,)``, ``labels`` ``(K,)`` category ids and ``label_names`` (K strings),
        highest score first, scores at least ``score_threshold`` (default: the
        predictor's).
        """
        single = not isinstance(images, (list, tuple))
        batch = [images] if single else list(images)
        threshold = self.score_threshold if score_threshold is None else float(score_threshold)
        pixels = [to_uint8_image(image, self.cfg.data.max_image_pixels) for image in batch]
        results = []
        for start in range(0, len(pixels), batch_size):
            results += self.detect(pixels[start:start + batch_size])
        kept = [self._kept(result, threshold) for result in results]
        return kept[0] if single else kept


__all__ = ["ImageInput", "Predictor"]
