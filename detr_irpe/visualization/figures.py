"""Figures over an image: predictions, encoder self-attention, decoder cross-attention.

All functions take an :class:`~detr_irpe.data.inputs.InputImage` (the original
picture plus the model input) and, for attention, an
:class:`~detr_irpe.visualization.attention.AttentionRecord` of that image; coordinates
(points, boxes) are in original-image pixels. Attention maps are drawn on the padded
feature grid stretched over the padded input, so every cell lies exactly over the pixels
it stands for (the padding falls outside the axes).

Every map is blended over the image (a grey copy, so that hue comes from the colour map
only) with alpha :data:`MAP_ALPHA`: the picture stays visible through the colours. Every
map has a labelled colour bar that says its scale: the encoder and decoder attention maps
are each divided by their own maximum (colours 0 to 1, the maximum in the panel's
title), the iRPE-contribution maps show absolute values.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import patheffects
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor

from detr_irpe.data.inputs import InputImage
from detr_irpe.models.box_ops import clip_boxes_to_image
from detr_irpe.models.postprocess import PostProcess

from ._mpl import fit_suptitle, hide_ticks, new_figure, save_figure
from .attention import AttentionRecord, token_to_cell
from .draw import DRAW_NMS_IOU, class_colour, suppress_duplicates, text_colour

logger = logging.getLogger(__name__)

# opacity of an attention map over its image: enough to read the colour map, little
# enough that the picture stays visible (about half of its contrast shows through)
MAP_ALPHA = 0.55
# the colour-bar label of the maps divided by their own maximum (the titles give it)
NORMALISED_LABEL = "attention weight / map max"

__all__ = [
    "MAP_ALPHA",
    "NORMALISED_LABEL",
    "Detections",
    "detections_from_outputs",
    "category_name",
    "plot_predictions",
    "plot_encoder_attention",
    "plot_rpe_contribution",
    "plot_decoder_attention",
]


# --------------------------------------------------------------------------- detections


@dataclass
class Detections:
    """Kept predictions of one image, best first.

    Attributes:
        boxes: ``(N, 4)`` absolute (x1, y1, x2, y2) in original-image pixels.
        scores: ``(N,)`` class probabilities.
        labels: ``(N,)`` category ids.
        queries: ``(N,)`` index of the object query that made each detection.
    """

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    queries: np.ndarray

    def __len__(self) -> int:
        return len(self.scores)

    def centres(self) -> list[tuple[float, float]]:
        """Box centres ``(x, y)``."""
        return [((b[0] + b[2]) / 2.0, (b[1] + b[3]) / 2.0) for b in self.boxes]

    def without_duplicates(self, iou: float = DRAW_NMS_IOU) -> Detections:
        """The detections to draw: near-duplicates of one object (same class, IoU >= ``iou``)
        left out, best first (:func:`~detr_irpe.visualization.draw.suppress_duplicates`)."""
        keep = suppress_duplicates(torch.from_numpy(self.boxes), torch.from_numpy(self.scores),
                                   torch.from_numpy(self.labels), iou).numpy()
        return Detections(self.boxes[keep], self.scores[keep], self.labels[keep],
                          self.queries[keep])


def detections_from_outputs(
    outputs: Mapping[str, Tensor],
    original_size: tuple[int, int],
    threshold: float = 0.7,
    max_detections: int | None = None,
    min_detections: int = 0,
    batch_index: int = 0,
    category_ids: Sequence[int] | None = None,
    sigmoid: bool | None = None,
) -> Detections:
    """Post-processing of one image, one detection per query, keeping queries with
    score >= ``threshold``.

    Args:
        outputs: ``pred_logits (B, Q, C+1)``, ``pred_boxes (B, Q, 4)`` cxcywh in [0, 1]
            of the un-padded image. The dab decoder's outputs (DAB-DETR / DN-DETR: they
            carry ``anchors``) have ``C`` sigmoid logits: a query's score is then its best
            class's sigmoid.
        original_size: ``(h0, w0)`` to scale boxes to (and cut them to).
        threshold: minimum score (max class probability, "no object" excluded).
        max_detections: keep at most this many (best first).
        min_detections: keep at least this many even below the threshold (useful for an
            untrained model, whose scores are all low).
        category_ids: the model's ``model.category_ids`` (remapped categories): labels
            come out as those category ids; None: the class indices are the ids.
        sigmoid: the logits are one sigmoid per class, no "no object" column (the
            family's ``sigmoid_classes``: DAB-DETR, RT-DETR); None: when the outputs
            carry ``anchors`` (the dab decoder's).
    """
    single = {key: outputs[key][batch_index:batch_index + 1].detach().float().cpu()
              for key in ("pred_logits", "pred_boxes")}
    postprocess = PostProcess(category_ids)
    result = postprocess(single, torch.tensor([list(original_size)]))[0]
    if sigmoid is None:
        sigmoid = "anchors" in outputs
    if sigmoid:  # sigmoid classes, no "no object" column (PostProcess: boxes)
        scores, labels = single["pred_logits"][0].sigmoid().max(-1)
        result["scores"], result["labels"] = scores, postprocess.category_of(labels)
    scores = result["scores"]
    order = torch.argsort(scores, descending=True)
    keep = [int(q) for q in order if scores[q] >= threshold]
    if len(keep) < min_detections:
        keep = [int(q) for q in order[:min_detections]]
    if max_detections is not None:
        keep = keep[:max_detections]
    idx = torch.tensor(keep, dtype=torch.long)
    boxes = clip_boxes_to_image(result["boxes"][idx], *original_size)
    return Detections(boxes=boxes.numpy().reshape(-1, 4),
                      scores=scores[idx].numpy(), labels=result["labels"][idx].numpy(),
                      queries=idx.numpy())


def category_name(label: int, names: Mapping[int, str] | Sequence[str] | None) -> str:
    """The name of a category id, or ``"class {id}"`` when unknown."""
    label = int(label)
    if names is not None:
        try:
            name = names[label]
            if name:
                return str(name)
        except (KeyError, IndexError):
            pass
    return f"class {label}"


# --------------------------------------------------------------------------- drawing helpers

def _draw_box(ax, box: Sequence[float], colour: str, text: str | None = None,
              linewidth: float = 2.2, fontsize: float = 9.0):
    """A box in ``colour`` with a thin black / white halo (visible on any background) and
    an optional label on a filled box of the same colour; returns the label artist."""
    x1, y1, x2, y2 = (float(v) for v in box)
    contrast = text_colour(colour)
    halo = [patheffects.Stroke(linewidth=linewidth + 1.6, foreground=contrast),
            patheffects.Normal()]
    ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor=colour,
                           linewidth=linewidth, path_effects=halo))
    if not text:
        return None
    return ax.text(x1, y1, text, fontsize=fontsize, color=contrast, va="bottom", ha="left",
                   fontweight="bold", clip_on=False,
                   bbox=dict(facecolor=colour, alpha=1.0, pad=1.5, edgecolor=contrast,
                             linewidth=0.6))


def _keep_labels_inside(fig: Figure, ax, labels: Sequence) -> None:
    """Move labels that stick out of ``ax`` back inside it (a box at the image border
    would otherwise push its label off the axes or the canvas); the first draw fixes
    the layout, so positions are measured in the final pixels."""
    labels = [label for label in labels if label is not None]
    if not labels:
        return
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    to_data = ax.transData.inverted()
    for label in labels:
        extent = label.get_bbox_patch().get_window_extent(renderer)
        dx = max(inside.x0 - extent.x0, 0.0) - max(extent.x1 - inside.x1, 0.0)
        dy = max(inside.y0 - extent.y0, 0.0) - max(extent.y1 - inside.y1, 0.0)
        if dx or dy:
            x, y = label.get_position()
            px, py = ax.transData.transform((x, y))
            label.set_position(tuple(to_data.transform((px + dx, py + dy))))


def _map_extent(image: InputImage, record: AttentionRecord, batch_index: int
                ) -> tuple[float, float, float, float]:
    """imshow extent of the padded grid in original-image pixels."""
    h0, w0 = image.original_size
    h, w = record.image_sizes[batch_index]
    hp, wp = record.input_size
    return (0.0, wp * w0 / w, hp * h0 / h, 0.0)


def _scale(image: InputImage, record: AttentionRecord, batch_index: int) -> tuple[float, float]:
    h0, w0 = image.original_size
    h, w = record.image_sizes[batch_index]
    return h0 / h, w0 / w


@dataclass(frozen=True)
class MapScale:
    """How :func:`_show_map` colours a map (its keywords).

    Colours span ``[0, vmax]`` (``[-vmax, vmax]`` and ``RdBu_r`` when ``diverging``, else
    ``cmap``); ``vmax`` defaults to the largest ``|value|`` of the non-padded cells. With
    ``normalise`` the map is divided by that maximum and the colours span ``[0, 1]``.
    """

    cmap: str = "inferno"
    diverging: bool = False
    vmax: float | None = None
    normalise: bool = False


def _show_map(ax, image: InputImage, record: AttentionRecord, batch_index: int,
              data: np.ndarray, **scale: Any):
    """An ``(H, W)`` map blended over the image (grey) with alpha :data:`MAP_ALPHA`,
    coloured as :class:`MapScale` (``scale``: its fields) says.

    Returns:
        ``(artist, peak)``: the map's ``AxesImage`` and the maximum it was scaled by.
    """
    cmap, diverging, vmax, normalise = astuple(MapScale(**scale))
    h0, w0 = image.original_size
    grey = image.display.mean(axis=2)
    ax.imshow(grey, cmap="gray", vmin=0, vmax=255, extent=(0, w0, h0, 0))
    valid = ~record.padding[batch_index].numpy()
    shown = np.where(valid, data, np.nan)
    if vmax is None:
        finite = np.isfinite(shown)
        vmax = float(np.abs(shown[finite]).max()) if finite.any() else 1.0
    vmax = vmax or 1.0
    if normalise:
        shown, limit = shown / vmax, 1.0
    else:
        limit = vmax
    if diverging:
        kwargs = dict(cmap="RdBu_r", vmin=-limit, vmax=limit)
    else:
        kwargs = dict(cmap=cmap, vmin=0.0, vmax=limit)
    artist = ax.imshow(shown, extent=_map_extent(image, record, batch_index),
                       interpolation="nearest", alpha=MAP_ALPHA, **kwargs)
    ax.set_xlim(0, w0)
    ax.set_ylim(h0, 0)
    hide_ticks(ax)
    return artist, vmax


def _colorbar(fig: Figure, artist, ax, label: str, **kwargs):
    """A colour bar of ``artist`` beside ``ax`` (one axes or a list), labelled ``label``.

    The bar shows the colour map itself, opaque: the map's alpha would only blend the
    bar with the white page, a background the map never has.
    """
    bar = fig.colorbar(artist, ax=ax, label=label, **kwargs)
    bar.solids.set_alpha(1.0)
    bar.ax.tick_params(labelsize=7)
    bar.ax.yaxis.label.set_size(8)
    return bar


def _mark_point(ax, x: float, y: float, colour: str = "cyan") -> None:
    ax.plot(x, y, marker="o", markersize=9, markerfacecolor="none", markeredgecolor=colour,
            markeredgewidth=2)
    ax.plot(x, y, marker="+", markersize=9, color=colour)


# --------------------------------------------------------------------------- predictions


def plot_predictions(
    image: InputImage,
    detections: Detections,
    category_names: Mapping[int, str] | Sequence[str] | None = None,
    out: str | Path | None = None,
    title: str | None = None,
    nms_iou: float | None = DRAW_NMS_IOU,
) -> Figure:
    """Boxes, class names and scores over the image.

    Near-duplicate boxes of one object (same class, IoU >= ``nms_iou``) are drawn once,
    the best-scoring one (``nms_iou=None`` draws every detection); the title counts both.
    """
    h0, w0 = image.original_size
    shown = detections.without_duplicates(nms_iou) if nms_iou is not None else detections
    fig, axes = new_figure(1, 1, panel_size=(8.0, 8.0 * h0 / w0))
    ax = axes[0][0]
    ax.imshow(image.display)
    labels = []
    # worst first, so that the best box and its label end up on top
    for box, label, score in reversed(list(zip(shown.boxes, shown.labels, shown.scores))):
        text = f"{category_name(label, category_names)} {score:.2f}"
        labels.append(_draw_box(ax, box, class_colour(int(label)), text, linewidth=2.6,
                                fontsize=10))
    hide_ticks(ax)
    hidden = len(detections) - len(shown)
    default_title = f"{image.name}: {len(shown)} detection{'s' if len(shown) != 1 else ''}" + (
        f" ({hidden} near-duplicate{'s' if hidden > 1 else ''} not drawn)" if hidden else "")
    ax.set_title(title or default_title, fontsize=11)
    _keep_labels_inside(fig, ax, labels)
    save_figure(fig, out)
    return fig


# --------------------------------------------------------------------------- encoder


def _point_tokens(image: InputImage, record: AttentionRecord, points: Sequence[tuple[float, float]],
                  batch_index: int) -> list[int]:
    scale = _scale(image, record, batch_index)
    return [record.token(x, y, batch_index, scale=scale) for x, y in points]


def plot_encoder_attention(
    image: InputImage,
    record: AttentionRecord,
    points: Sequence[tuple[float, float]],
    layer: int = -1,
    out: str | Path | None = None,
    batch_index: int = 0,
    heads: Sequence[int] | None = None,
) -> Figure:
    """Encoder self-attention of reference points: rows = points, columns = the point on
    the image, the mean over heads, then every head (or ``heads``).

    Each map is divided by its own maximum (in the panel's title): one colour bar,
    0 to 1, serves them all.

    Args:
        points: ``(x, y)`` in original-image pixels; each maps to the feature cell that
            holds it (:func:`~detr_irpe.visualization.attention.pixel_to_token`).
        layer: encoder layer (negative counts from the end).
    """
    if not points:
        raise ValueError("plot_encoder_attention needs at least one reference point")
    tokens = _point_tokens(image, record, points, batch_index)
    layer_idx = record.layer_index("encoder", layer)
    first = record.encoder_maps(layer_idx, tokens[0], batch_index)
    head_ids = list(range(first.shape[0])) if heads is None else list(heads)
    h0, w0 = image.original_size
    cols = 2 + len(head_ids)
    fig, axes = new_figure(len(points), cols, panel_size=(2.6, 2.6 * h0 / w0 + 0.35))
    artist = None
    for r, ((x, y), token) in enumerate(zip(points, tokens)):
        maps = record.encoder_maps(layer_idx, token, batch_index).numpy()
        row_axes = axes[r]
        row_axes[0].imshow(image.display)
        _mark_point(row_axes[0], x, y)
        hide_ticks(row_axes[0])
        cell = token_to_cell(token, record.hw)
        row_axes[0].set_title(f"point ({x:.0f}, {y:.0f}) -> cell {cell}", fontsize=8)
        panels = [("mean of heads", maps.mean(axis=0))] + [(f"head {h}", maps[h])
                                                            for h in head_ids]
        for ax, (title, data) in zip(row_axes[1:], panels):
            artist, peak = _show_map(ax, image, record, batch_index, data, normalise=True)
            _mark_point(ax, x, y)
            ax.set_title(f"{title} (max {peak:.3g})", fontsize=8)
    _colorbar(fig, artist, [ax for row in axes for ax in row[1:]], NORMALISED_LABEL,
              shrink=0.8, aspect=30)
    fit_suptitle(fig, f"{image.name}: encoder layer {layer_idx} self-attention "
                      f"(grid {record.hw[0]}x{record.hw[1]}; each map / its max)", fontsize=10)
    save_figure(fig, out)
    return fig


def plot_rpe_contribution(
    image: InputImage,
    record: AttentionRecord,
    points: Sequence[tuple[float, float]],
    layer: int = -1,
    out: str | Path | None = None,
    batch_index: int = 0,
    head: int | None = None,
) -> Figure:
    """What iRPE adds to the encoder attention of reference points.

    Columns: the point; softmax(content + iRPE) (the model's attention);
    softmax(content) (the same layer without the iRPE term); their difference; the iRPE
    logits. Mean over heads, or one ``head``. Needs a record captured with ``rpe_split``.
    Absolute values, each panel with a labelled colour bar: the two softmaxes share one
    range ``[0, max of both]``, the difference and the logits are symmetric about 0.
    """
    if not points:
        raise ValueError("plot_rpe_contribution needs at least one reference point")
    if not record.encoder_content:
        raise ValueError("the record has no iRPE split; capture with rpe_split=True")
    tokens = _point_tokens(image, record, points, batch_index)
    layer_idx = record.layer_index("encoder", layer)
    h0, w0 = image.original_size
    # (what, title, diverging, colour-bar label)
    columns = [("weights", "with iRPE: softmax(content + rpe)", False, "attention weight"),
               ("content", "without iRPE: softmax(content)", False, "attention weight"),
               ("difference", "difference (with - without)", True, "weight difference"),
               ("rpe_logits", "iRPE logits", True, "iRPE logit")]
    fig, axes = new_figure(len(points), 1 + len(columns),
                           panel_size=(2.9, 2.9 * h0 / w0 + 0.35))
    for r, ((x, y), token) in enumerate(zip(points, tokens)):
        row_axes = axes[r]
        row_axes[0].imshow(image.display)
        _mark_point(row_axes[0], x, y)
        hide_ticks(row_axes[0])
        row_axes[0].set_title(f"point ({x:.0f}, {y:.0f}) -> cell "
                              f"{token_to_cell(token, record.hw)}", fontsize=8)
        datas = []
        for what, *_ in columns:
            maps = record.encoder_maps(layer_idx, token, batch_index, what=what).numpy()
            datas.append(maps.mean(axis=0) if head is None else maps[head])
        valid = ~record.padding[batch_index].numpy()
        # one scale for both softmaxes, so that with / without iRPE compare directly
        shared = float(max(datas[0][valid].max(), datas[1][valid].max()))
        for ax, (what, title, diverging, label), data in zip(row_axes[1:], columns, datas):
            artist, _ = _show_map(ax, image, record, batch_index, data, diverging=diverging,
                                  vmax=shared if what in ("weights", "content") else None)
            _mark_point(ax, x, y, colour="lime")
            _colorbar(fig, artist, ax, label, shrink=0.7)
            ax.set_title(title, fontsize=8)
    who = "mean of heads" if head is None else f"head {head}"
    fit_suptitle(fig, f"{image.name}: iRPE contribution, encoder layer {layer_idx} ({who}; "
                      "absolute values)", fontsize=10)
    save_figure(fig, out)
    return fig


# --------------------------------------------------------------------------- decoder


def plot_decoder_attention(
    image: InputImage,
    record: AttentionRecord,
    detections: Detections,
    category_names: Mapping[int, str] | Sequence[str] | None = None,
    layer: int = -1,
    out: str | Path | None = None,
    batch_index: int = 0,
    max_columns: int = 4,
) -> Figure:
    """The DETR paper's figure: per kept detection, the decoder cross-attention (mean of
    heads) of its object query over the image, next to its box; first panel = all boxes.
    Each map is divided by its own maximum (in the panel's title); one colour bar."""
    layer_idx = record.layer_index("decoder", layer)
    panels = len(detections) + 1
    cols = min(panels, max_columns)
    rows = -(-panels // cols)
    h0, w0 = image.original_size
    fig, axes = new_figure(rows, cols, panel_size=(3.2, 3.2 * h0 / w0 + 0.35))
    flat = [ax for row in axes for ax in row]
    flat[0].imshow(image.display)
    for box, label in zip(detections.boxes, detections.labels):
        _draw_box(flat[0], box, class_colour(int(label)))
    hide_ticks(flat[0])
    flat[0].set_title(f"{len(detections)} detections", fontsize=9)
    for i, (box, label, score, query) in enumerate(zip(
            detections.boxes, detections.labels, detections.scores, detections.queries)):
        ax = flat[i + 1]
        data = record.decoder_maps(int(query), layer_idx, batch_index).mean(0).numpy()
        artist, peak = _show_map(ax, image, record, batch_index, data, cmap="viridis",
                                 normalise=True)
        _draw_box(ax, box, class_colour(int(label)))
        ax.set_title(f"query {int(query)}: {category_name(label, category_names)} "
                     f"{score:.2f}\n(max {peak:.3g})", fontsize=8)
    for ax in flat[panels:]:
        ax.axis("off")
    if len(detections):
        _colorbar(fig, artist, flat[1:panels], NORMALISED_LABEL, shrink=0.8, aspect=30)
    fit_suptitle(fig, f"{image.name}: decoder layer {layer_idx} cross-attention "
                      "(mean of heads; each map / its max)", fontsize=10)
    save_figure(fig, out)
    return fig
