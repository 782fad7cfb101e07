"""DAB-DETR's anchor boxes over the image: where a query looks, and how its box moves.

The dab decoder (DAB-DETR / DN-DETR) returns ``anchors`` ``(layers, B, Q, 4)``: the box
(cx, cy, w, h relative to the un-padded image) each decoder layer started from. Layer 0's
is the learned anchor ``sigmoid(refpoint_embed)``; layer ``l > 0`` starts from the box
layer ``l - 1`` refined; ``pred_boxes`` is the last layer's refinement. Two figures:

- :func:`plot_anchor_attention`: per kept detection, the cross-attention (mean of heads)
  of its query in one decoder layer, with the anchor box that layer started from (dashed)
  and the predicted box (solid). DAB-DETR's width / height modulation scales the
  attention's spatial term by the anchor's size, so the map spreads with the box.
- :func:`plot_anchor_refinement`: per kept detection, the anchors of every layer (one
  colour per layer) and the predicted box, their centres joined in layer order.

Boxes are drawn in original-image pixels (:func:`anchor_boxes`). Every box patch carries a
``gid`` (``anchor:<query>:<layer>``, ``prediction:<query>``) and every centre path
``path:<query>``, so a figure's content can be read back from its matplotlib objects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps, patheffects
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from torch import Tensor

from detr_irpe.data.inputs import InputImage
from detr_irpe.errors import ConfigError
from detr_irpe.models.box_ops import box_cxcywh_to_xyxy

from ._mpl import fit_suptitle, hide_ticks, new_figure, save_figure
from .attention import AttentionRecord
from .draw import class_colour
from .figures import NORMALISED_LABEL, Detections, _colorbar, _draw_box, _show_map, category_name

logger = logging.getLogger(__name__)

__all__ = ["anchor_boxes", "has_anchors", "layer_colours", "plot_anchor_attention",
           "plot_anchor_refinement"]

# the anchor a layer started from: dashed, over a dark halo (visible on the attention map)
ANCHOR_COLOUR = "white"


def has_anchors(outputs: Mapping[str, object]) -> bool:
    """True for the outputs of the dab decoder (DAB-DETR / DN-DETR), which carry ``anchors``."""
    return "anchors" in outputs


def anchor_boxes(
    outputs: Mapping[str, Tensor], original_size: tuple[int, int], batch_index: int = 0
) -> np.ndarray:
    """``(layers + 1, Q, 4)`` boxes (x1, y1, x2, y2) in original-image pixels: the box each
    decoder layer started from (row 0: the learned anchors), then the predicted boxes.

    Args:
        outputs: a dab decoder's outputs (``anchors`` ``(layers, B, Q, 4)`` and
            ``pred_boxes`` ``(B, Q, 4)``, cxcywh relative to the un-padded image).
        original_size: ``(h0, w0)`` of the picture the boxes are drawn on.

    Raises:
        ConfigError: the outputs have no anchors (not a ``model.family=dab`` model).
    """
    if not has_anchors(outputs):
        raise ConfigError("anchor figures need a model with the dab decoder (DAB-DETR / "
                          "DN-DETR, model.family=dab); this model's outputs have no anchors")
    anchors = outputs["anchors"][:, batch_index]  # (layers, Q, 4)
    final = outputs["pred_boxes"][batch_index][None]  # (1, Q, 4)
    boxes = torch.cat((anchors, final)).detach().float().cpu()
    h0, w0 = original_size
    return (box_cxcywh_to_xyxy(boxes) * torch.tensor([w0, h0, w0, h0])).numpy()


def layer_colours(layers: int) -> list[tuple[float, float, float, float]]:
    """One colour per decoder layer, dark (layer 0) to bright (the last), from ``plasma``
    without its near-white end."""
    cmap = colormaps["plasma"]
    return [cmap(0.85 * i / max(layers - 1, 1)) for i in range(layers)]


def _box(ax, box: Sequence[float], colour, gid: str, linestyle: str = "--",
         linewidth: float = 1.6) -> Rectangle:
    """An unfilled box with a thin black halo, tagged ``gid``."""
    x1, y1, x2, y2 = (float(v) for v in box)
    halo = [patheffects.Stroke(linewidth=linewidth + 1.4, foreground="black"),
            patheffects.Normal()]
    patch = Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor=colour,
                      linewidth=linewidth, linestyle=linestyle, path_effects=halo, gid=gid)
    ax.add_patch(patch)
    return patch


def _prediction(ax, box: Sequence[float], label: int, query: int) -> None:
    """The predicted box in its class colour (as the other figures draw it), tagged."""
    _draw_box(ax, box, class_colour(int(label)))
    ax.patches[-1].set_gid(f"prediction:{query}")


def _panels(count: int, image: InputImage, max_columns: int, size: float):
    """``(fig, flat axes, columns)``: ``count`` panels in rows of at most ``max_columns``."""
    cols = max(min(count, max_columns), 1)
    rows = -(-max(count, 1) // cols)
    h0, w0 = image.original_size
    fig, axes = new_figure(rows, cols, panel_size=(size, size * h0 / w0 + 0.35))
    return fig, [ax for row in axes for ax in row], cols


def _blank_panels(flat: list, image: InputImage, count: int) -> None:
    """Panels beyond the ``count`` detections hidden; without any, the image alone."""
    if not count:
        flat[0].imshow(image.display)
        hide_ticks(flat[0])
        flat[0].set_title("no detections", fontsize=9)
    for ax in flat[max(count, 1):]:
        ax.axis("off")


def _title(detections: Detections, i: int, names) -> str:
    return (f"query {int(detections.queries[i])}: "
            f"{category_name(detections.labels[i], names)} {detections.scores[i]:.2f}")


def plot_anchor_attention(
    image: InputImage,
    record: AttentionRecord,
    detections: Detections,
    category_names: Mapping[int, str] | Sequence[str] | None = None,
    layer: int = -1,
    out: str | Path | None = None,
    batch_index: int = 0,
    max_columns: int = 4,
) -> Figure:
    """Per kept detection: its query's cross-attention (mean of heads) in decoder layer
    ``layer``, the anchor box that layer started from (white, dashed) and the predicted box
    (class colour). ``record``: captured from a dab-decoder model with that layer.

    Raises:
        ConfigError: the record is not of a dab-decoder model.
        ValueError: the decoder layer was not captured.
    """
    boxes = anchor_boxes(record.outputs, image.original_size, batch_index)
    layer_idx = record.layer_index("decoder", layer)
    fig, flat, _ = _panels(len(detections), image, max_columns, 3.2)
    for i, (query, label) in enumerate(zip(detections.queries, detections.labels)):
        ax = flat[i]
        data = record.decoder_maps(int(query), layer_idx, batch_index).mean(0).numpy()
        artist, peak = _show_map(ax, image, record, batch_index, data, cmap="viridis",
                                 normalise=True)
        _box(ax, boxes[layer_idx, int(query)], ANCHOR_COLOUR, f"anchor:{int(query)}:{layer_idx}")
        _prediction(ax, boxes[-1, int(query)], int(label), int(query))
        ax.set_title(f"{_title(detections, i, category_names)}\n(max {peak:.3g})", fontsize=8)
    _blank_panels(flat, image, len(detections))
    if len(detections):
        _colorbar(fig, artist, flat[:len(detections)], NORMALISED_LABEL, shrink=0.8, aspect=30)
    fit_suptitle(fig, f"{image.name}: decoder layer {layer_idx} cross-attention (mean of "
                      f"heads; each map / its max), dashed: the anchor box layer {layer_idx} "
                      "started from",
                 fontsize=10)
    save_figure(fig, out)
    return fig


def plot_anchor_refinement(
    image: InputImage,
    outputs: Mapping[str, Tensor],
    detections: Detections,
    category_names: Mapping[int, str] | Sequence[str] | None = None,
    out: str | Path | None = None,
    batch_index: int = 0,
    max_columns: int = 4,
) -> Figure:
    """Per kept detection: the box its query started each decoder layer from (dashed, one
    colour per layer, layer 0 = the learned anchor), the predicted box (class colour) and
    the path of the box centre through the layers.

    Raises:
        ConfigError: the outputs are not of a dab-decoder model.
    """
    boxes = anchor_boxes(outputs, image.original_size, batch_index)
    layers = boxes.shape[0] - 1
    colours = layer_colours(layers)
    fig, flat, cols = _panels(len(detections), image, max_columns, 3.2)
    for i, (query, label) in enumerate(zip(detections.queries, detections.labels)):
        ax, q = flat[i], int(query)
        ax.imshow(image.display)
        for layer in range(layers):
            _box(ax, boxes[layer, q], colours[layer], f"anchor:{q}:{layer}")
        _prediction(ax, boxes[-1, q], int(label), q)
        centres = (boxes[:, q, :2] + boxes[:, q, 2:]) / 2.0  # (layers + 1, 2): x, y
        ax.plot(centres[:, 0], centres[:, 1], color="white", linewidth=1.0, marker="o",
                markersize=3, markeredgecolor="black", gid=f"path:{q}")
        h0, w0 = image.original_size
        ax.set_xlim(0, w0)
        ax.set_ylim(h0, 0)
        hide_ticks(ax)
        ax.set_title(_title(detections, i, category_names), fontsize=8)
    _blank_panels(flat, image, len(detections))
    handles = [Line2D([], [], color=colours[layer], linestyle="--",
                      label="layer 0 start: learned anchor" if layer == 0
                      else f"layer {layer} start") for layer in range(layers)]
    handles.append(Line2D([], [], color="grey", label="prediction (class colour)"))
    # one legend entry per panel width: a one-panel figure stacks them, and the figure
    # grows by the legend's rows instead of shrinking the panels
    ncols = min(len(handles), cols)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + 0.2 * -(-len(handles) // ncols) + 0.1)
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8)
    fit_suptitle(fig, f"{image.name}: anchor boxes through the {layers} decoder layers "
                      "(box refinement)", fontsize=10)
    save_figure(fig, out)
    return fig
