"""One call that writes the standard figures of a model on one image (used by ``make demo``
and ``visualize all``): the figures every family has, then those of its own
(``DetectorFamily.figures``); a figure the family lacks is skipped with one logged line
that says why."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from detr_irpe.data.images import DEFAULT_MAX_IMAGE_PIXELS
from detr_irpe.data.inputs import InputImage, prepare_image
from detr_irpe.errors import ConfigError
from detr_irpe.family import family_of_model
from detr_irpe.structures import ImageBatch

from .anchors import has_anchors, plot_anchor_attention, plot_anchor_refinement
from .attention import (
    AttentionRecord,
    capture_attention,
    decoder_attention_modules,
    encoder_attention_modules,
    model_device,
)
from .distributions import edge_distributions, has_edge_distributions, plot_edge_distributions
from .figures import (
    detections_from_outputs,
    plot_decoder_attention,
    plot_encoder_attention,
    plot_predictions,
    plot_rpe_contribution,
)
from .queries import has_selected_queries, plot_selected_queries

logger = logging.getLogger(__name__)

__all__ = ["MapSettings", "save_attention_maps", "has_irpe", "distinct_points"]


def has_irpe(model: nn.Module) -> bool:
    """True when some encoder self-attention carries iRPE logits terms (q or k tables)."""
    try:
        modules = encoder_attention_modules(model)
    except ConfigError:  # a family without attention figures
        return False
    return any(_has_logit_tables(attention) for attention in modules)


def _has_logit_tables(attention: nn.Module) -> bool:
    """Whether an attention's iRPE (its ``encodings.irpe`` entry, or the attention
    itself in the layout before issue 48) has q or k tables."""
    entries = getattr(attention, "encodings", None)
    irpe = attention
    if isinstance(entries, nn.ModuleDict) and "irpe" in entries:
        irpe = entries["irpe"]
    return (getattr(irpe, "rpe_k", None) is not None
            or getattr(irpe, "rpe_q", None) is not None)


def _attention_layers(model: nn.Module) -> tuple[bool, bool]:
    """Whether the model has encoder / dense decoder attention the figures can read."""
    try:
        return bool(encoder_attention_modules(model)), bool(decoder_attention_modules(model))
    except ConfigError:
        return False, False


@torch.no_grad()
def _eval_outputs(model: nn.Module, inputs: list[Tensor]) -> dict:
    """The model's eval-mode outputs (its mode restored afterwards)."""
    was_training = model.training
    model.eval()
    try:
        return model(ImageBatch.from_images(inputs))
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class MapSettings:
    """The options of :func:`save_attention_maps` (its keywords).

    Reading the image:
        size, max_size: eval-time resize (``cfg.data.val_size`` / ``cfg.data.max_size``);
            ``size=None`` feeds the image at its own size.
        normalized: a ``(3, H, W)`` tensor image is already normalised.
        max_pixels: an image file declaring more pixels is refused before decoding
            (``cfg.data.max_image_pixels``).

    The detections shown:
        category_names: id -> name (or a list) for the labels.
        category_ids: the model's ``model.category_ids`` when it was trained on remapped
            categories (labels then show the original ids' names).
        threshold: detections kept at score >= threshold ...
        min_detections: ... but at least this many (an untrained model scores low) ...
        max_detections: ... and at most this many.

    The figures:
        layer: encoder layer of the encoder figures (-1 = last).
        points: encoder reference points ``(x, y)`` in image pixels; default the centres of
            the kept detections (the image centre when there are none).
        rpe_contribution: also write the iRPE-split figure (models with iRPE on q / k only).
        prefix: file-name prefix.
        distributions_top_k: D-FINE / DEIM: the best detections of the edge-distribution
            figure (at most the model's queries).
    """

    size: int | None = 800
    max_size: int | None = 1333
    normalized: bool = False
    max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    category_names: Mapping[int, str] | Sequence[str] | None = None
    category_ids: Sequence[int] | None = None
    threshold: float = 0.7
    min_detections: int = 3
    max_detections: int = 6
    layer: int = -1
    points: Sequence[tuple[float, float]] | None = None
    rpe_contribution: bool = True
    prefix: str = ""
    distributions_top_k: int = 4


def save_attention_maps(
    model: nn.Module,
    image: str | Path | np.ndarray | Tensor | InputImage,
    out_dir: str | Path,
    settings: MapSettings | None = None,
    **options: Any,
) -> dict[str, Path]:
    """Predictions, encoder attention (+ iRPE contribution) and decoder attention as PNGs.

    Args:
        model: a DETR (any device; its train/eval mode is restored afterwards).
        image: a path, ``(H, W, 3)`` uint8 array, ``(3, H, W)`` tensor (uint8 / [0, 1], or
            normalised with ``normalized=True``) or a prepared :class:`InputImage`.
        out_dir: folder for the figures (created).
        settings: the options (:class:`MapSettings`); ``options``: its fields as keywords
            (``size=..., threshold=...``), over ``settings``.

    Returns:
        ``{"predictions", "encoder_attention", "rpe_contribution" (when written),
        "decoder_attention" (a family with dense decoder cross-attention), and the
        family's own figures: for a dab-decoder model (DAB-DETR / DN-DETR)
        "anchor_attention" and "anchor_refinement", for RT-DETR "selected_queries", for
        D-FINE / DEIM "selected_queries" and "distributions"}`` ->
        PNG path. A figure the model lacks is skipped with one logged warning saying why.
    """
    opts = replace(settings or MapSettings(), **options)
    out_dir = Path(out_dir)
    prepared = image if isinstance(image, InputImage) else prepare_image(
        image, size=opts.size, max_size=opts.max_size, normalized=opts.normalized,
        max_pixels=opts.max_pixels)
    family = family_of_model(model)
    split = opts.rpe_contribution and has_irpe(model)
    record, outputs = _run(model, prepared, family, opts.layer, split)
    detections = detections_from_outputs(
        outputs, prepared.original_size, threshold=opts.threshold,
        max_detections=opts.max_detections, min_detections=opts.min_detections,
        category_ids=opts.category_ids,
        sigmoid=family.sigmoid_classes if family is not None else None)
    figures = _Figures(prepared, detections, opts, out_dir)
    figures.plot("predictions", plot_predictions, prepared, detections, opts.category_names)
    if record is not None:
        figures.attention(record, split, family)
    if has_selected_queries(outputs):
        figures.plot("selected_queries", plot_selected_queries, prepared, outputs)
    if has_edge_distributions(model):
        queries = getattr(model, "module", model).decoder.num_queries
        edges = edge_distributions(model, prepared,
                                   top_k=min(opts.distributions_top_k, queries),
                                   category_ids=opts.category_ids)
        figures.plot("distributions", plot_edge_distributions, prepared, edges,
                     opts.category_names)
    logger.info("attention maps of %s written to %s", prepared.name, out_dir)
    return figures.written


def _run(model: nn.Module, prepared: InputImage, family, layer: int, split: bool
         ) -> tuple[AttentionRecord | None, dict]:
    """The model's outputs on the image, with its attention recorded where the family
    registers attention modules (``(None, outputs)`` otherwise, said in a warning)."""
    inputs = [prepared.tensor.to(model_device(model))]
    has_encoder, has_decoder = _attention_layers(model)
    if not (has_encoder or has_decoder):
        who = family.title if family is not None else type(model).__name__
        logger.warning("encoder-attention, decoder-attention skipped: %s registers no "
                       "attention modules", who)
        return None, _eval_outputs(model, inputs)
    record = capture_attention(model, inputs,
                               encoder_layers=[layer] if has_encoder else "none",
                               decoder_layers=[-1] if has_decoder else "none",
                               rpe_split=split)
    return record, record.outputs


class _Figures:
    """The figures of one image, written under ``out_dir`` as they are plotted."""

    def __init__(self, image: InputImage, detections, opts: MapSettings, out_dir: Path) -> None:
        self.image, self.detections, self.opts, self.out_dir = image, detections, opts, out_dir
        self.written: dict[str, Path] = {}

    def plot(self, name: str, plot: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        out = self.out_dir / f"{self.opts.prefix}{name}.png"
        plot(*args, out=out, **kwargs)
        self.written[name] = out

    def attention(self, record: AttentionRecord, split: bool, family) -> None:
        """The encoder (and iRPE-split) figures at the reference points, the decoder
        figure and the anchor figures, as far as the record holds them."""
        image, opts = self.image, self.opts
        if record.encoder:
            points = opts.points
            if points is None:
                points = distinct_points(self.detections.centres(), image, record, limit=4)
                if not points:
                    h0, w0 = image.original_size
                    points = [(w0 / 2.0, h0 / 2.0)]
            self.plot("encoder_attention", plot_encoder_attention, image, record, points,
                      layer=opts.layer)
            if split:
                self.plot("rpe_contribution", plot_rpe_contribution, image, record, points,
                          layer=opts.layer)
        if record.decoder:
            self.plot("decoder_attention", plot_decoder_attention, image, record,
                      self.detections, opts.category_names)
        else:
            logger.warning("decoder-attention skipped: %s", family.attention.no_decoder_figure)
        self.written.update(_anchor_figures(image, record, self.detections,
                                            opts.category_names, self.out_dir, opts.prefix))


def _anchor_figures(image: InputImage, record: AttentionRecord, detections,
                    category_names, out_dir: Path, prefix: str) -> dict[str, Path]:
    """The dab decoder's two anchor figures (none for DETR): the last layer's
    cross-attention with its anchors, and the anchors through the layers."""
    if not has_anchors(record.outputs):
        return {}
    written = {"anchor_attention": out_dir / f"{prefix}anchor_attention.png",
               "anchor_refinement": out_dir / f"{prefix}anchor_refinement.png"}
    plot_anchor_attention(image, record, detections, category_names,
                          out=written["anchor_attention"])
    plot_anchor_refinement(image, record.outputs, detections, category_names,
                           out=written["anchor_refinement"])
    return written


def distinct_points(points: Sequence[tuple[float, float]], image: InputImage,
                    record: AttentionRecord, limit: int | None = None,
                    batch_index: int = 0) -> list[tuple[float, float]]:
    """The first point of every feature cell (several detections often share a cell)."""
    h0, w0 = image.original_size
    h, w = record.image_sizes[batch_index]
    seen, kept = set(), []
    for x, y in points:
        x = min(max(float(x), 0.0), w0 - 1.0)  # box centres may leave the image slightly
        y = min(max(float(y), 0.0), h0 - 1.0)
        token = record.token(x, y, batch_index, scale=(h0 / h, w0 / w))
        if token not in seen:
            seen.add(token)
            kept.append((x, y))
    return kept[:limit]

