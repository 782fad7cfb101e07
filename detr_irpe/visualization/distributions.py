"""D-FINE's per-edge box distributions of a detection, as FDR refines them layer by layer.

A D-FINE / DEIM decoder layer (:mod:`detr_irpe.models.dfine.decoder`) predicts, for every
query and each of the four edges of its box (left, top, right, bottom), logits over
``reg_max + 1`` bins; each layer adds its logits to the previous layer's (Fine-grained
Distribution Refinement). The softmax of an edge's logits is a distribution over the bin
values ``W(n)`` of the non-uniform weighting function, and its mean (the integral
``sum_n p_n W(n)``) is the edge's offset ``d``: the edge lies ``d * size / c`` beyond its
place on the fixed reference box (``c = reg_scale``; ``size`` the reference box's width
for the left / right edges, its height for the top / bottom ones; positive = outwards).
:mod:`detr_irpe.models.dfine.distribution` holds the maths.

- :func:`edge_distributions` runs the model on one image with the decoder's
  ``record_layers`` switched on (:func:`recording_layers`; the model's usual outputs are
  unchanged), picks the ``top_k`` detections and returns, per detection and per decoded
  layer, the four distributions and their offsets (:class:`EdgeDistributions`) in the
  dtype the model computed them in; no drawing.
- :func:`plot_edge_distributions` draws one row per detection: the image around the box
  (final box solid, reference box dashed), then one panel per edge with one line per
  layer (light to dark) of the bin probabilities against ``W(n)``, the offset of each
  layer marked by a dashed vertical line of its colour.

The detections are the model's post-processing's (:class:`~detr_irpe.models.postprocess.
TopKPostProcess`: every (query, class) sigmoid score, best first), each query once: the
first ``top_k`` distinct queries in that order, i.e. the queries of highest best-class
score. Every line carries a ``gid`` (``distribution:<query>:<edge>:<layer>``,
``offset:<query>:<edge>:<layer>``, the boxes ``box:<query>`` and ``reference:<query>``), so
a figure's content can be read back from its matplotlib objects.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from torch import Tensor, nn

from detr_irpe.data.inputs import InputImage
from detr_irpe.errors import ConfigError
from detr_irpe.family import family_of_model
from detr_irpe.models.box_ops import box_cxcywh_to_xyxy
from detr_irpe.structures import ImageBatch

from ._mpl import fit_suptitle, hide_ticks, new_figure, save_figure
from .attention import model_device
from .draw import class_colour
from .figures import category_name

logger = logging.getLogger(__name__)

__all__ = ["EDGES", "EdgeDistributions", "LayerDistributions", "edge_distributions",
           "has_edge_distributions", "layer_colours", "plot_edge_distributions",
           "recording_layers"]

EDGES = ("left", "top", "right", "bottom")
# the layers' colours: this map from LIGHTEST (the first layer) to 1.0 (the last)
LAYER_CMAP = "Blues"
LIGHTEST = 0.35
# the most detections one figure draws (a row each: the figure must stay renderable)
MAX_TOP_K = 20
# the image around a detection: its box and its reference box, grown by this much per side
CROP_MARGIN = 0.25


def _dfine_decoder(model: nn.Module) -> Any:
    """The model's decoder when it is D-FINE's (it records its layers and has bin values,
    ``detr_irpe.models.dfine.decoder``), else None; asked, not imported, as the family
    registry has it."""
    decoder = getattr(getattr(model, "module", model), "decoder", None)
    return decoder if hasattr(decoder, "record_layers") and hasattr(decoder, "bin_values") \
        else None


def has_edge_distributions(model: nn.Module) -> bool:
    """True for a model with D-FINE's decoder (``model.family=dfine``: D-FINE, DEIM)."""
    return _dfine_decoder(model) is not None


def _checked_decoder(model: nn.Module) -> Any:
    decoder = _dfine_decoder(model)
    if decoder is None:
        family = family_of_model(model)
        who = (f"{family.title} (model.family={family.name})" if family is not None
               else type(getattr(model, "module", model)).__name__)
        raise ConfigError(f"distributions: {who} has no per-edge box distributions; the "
                          "figure needs a D-FINE / DEIM model (model.family=dfine)")
    return decoder


@contextmanager
def recording_layers(model: nn.Module) -> Iterator[Any]:
    """Within the block, the model's eval-mode outputs also carry ``layer_corners`` and
    ``ref_points`` (:meth:`~detr_irpe.models.dfine.decoder.DFINEDecoder.forward`); the
    decoder's previous setting is restored afterwards, also on errors.

    Raises:
        ConfigError: not a D-FINE / DEIM model.
    """
    decoder = _checked_decoder(model)
    before = decoder.record_layers
    decoder.record_layers = True
    try:
        yield decoder
    finally:
        decoder.record_layers = before


@dataclass(frozen=True)
class LayerDistributions:
    """One detection's four edges through the decoded layers (tensors on the CPU, in the
    dtype of the model's outputs).

    Attributes:
        query: the query's index in the outputs.
        score: its best class's sigmoid score.
        label: that class's category id.
        box: ``(4,)`` the predicted box, ``(x1, y1, x2, y2)`` in original-image pixels.
        reference: ``(4,)`` the fixed reference box of its distributions, same units.
        probabilities: ``(layers, 4, reg_max + 1)``: per layer and edge (left, top, right,
            bottom), the softmax of the distribution logits.
        offsets: ``(layers, 4)``: per layer and edge, ``sum_n p_n W(n)``, in units of the
            reference box's size / ``reg_scale`` (positive: outwards).
    """

    query: int
    score: float
    label: int
    box: Tensor
    reference: Tensor
    probabilities: Tensor
    offsets: Tensor

    def offset_pixels(self, reg_scale: float) -> Tensor:
        """``(layers, 4)``: the offsets in original-image pixels (``d * size / c``)."""
        x1, y1, x2, y2 = self.reference.unbind(-1)
        size = torch.stack([x2 - x1, y2 - y1, x2 - x1, y2 - y1])
        return self.offsets * size / abs(reg_scale)


@dataclass(frozen=True)
class EdgeDistributions:
    """What :func:`edge_distributions` returns.

    Attributes:
        bins: ``(reg_max + 1,)`` the bin values ``W(n)`` (the x-axis of the edge panels).
        reg_scale: ``c``: an offset ``d`` moves an edge by ``d * size / c``.
        layers: the decoder layers decoded (0 .. ``eval_idx``), one row of each
            detection's ``probabilities`` / ``offsets`` each; the last gives the boxes.
        detections: the chosen detections, best first.
        outputs: the model's outputs (with ``layer_corners`` and ``ref_points``).
        original_size: ``(h0, w0)`` the boxes' pixels are of.
    """

    bins: Tensor
    reg_scale: float
    layers: tuple[int, ...]
    detections: list[LayerDistributions]
    outputs: dict
    original_size: tuple[int, int]


def _top_queries(logits: Tensor, top_k: int) -> list[tuple[int, int, float]]:
    """``(query, class, score)`` of the first ``top_k`` distinct queries among the (query,
    class) pairs sorted by sigmoid score as the post-processing sorts them."""
    num_classes = logits.shape[-1]
    prob = logits.float().sigmoid().reshape(-1)
    order = prob.argsort(descending=True, stable=True)
    chosen: list[tuple[int, int, float]] = []
    seen: set[int] = set()
    for pair in order.tolist():
        query = pair // num_classes
        if query in seen:
            continue
        seen.add(query)
        chosen.append((query, pair % num_classes, float(prob[pair])))
        if len(chosen) == top_k:
            break
    return chosen


@torch.no_grad()
def edge_distributions(model: nn.Module, image: InputImage | Tensor, top_k: int = 4,
                       category_ids: Sequence[int] | None = None) -> EdgeDistributions:
    """The per-layer edge distributions of the ``top_k`` best detections of one image.

    Args:
        model: a D-FINE / DEIM model (any device and dtype; run in eval mode, its mode and
            the decoder's ``record_layers`` restored afterwards).
        image: a prepared image (:func:`~detr_irpe.data.inputs.prepare_image`; boxes in its
            original pixels) or its ``(3, H, W)`` model input (boxes in the input's pixels).
        top_k: how many detections (distinct queries), at most the model's query count.
        category_ids: the model's ``model.category_ids`` (None: class index = category id).

    Raises:
        ConfigError: not a D-FINE / DEIM model, or ``top_k`` outside ``1 .. queries``.
    """
    decoder = _checked_decoder(model)
    if not 1 <= top_k <= decoder.num_queries:
        raise ConfigError(f"--top-k {top_k}: between 1 and the model's "
                          f"{decoder.num_queries} queries (model.num_queries)")
    if isinstance(image, InputImage):
        tensor, original_size = image.tensor, image.original_size
    else:
        tensor, original_size = image, (int(image.shape[-2]), int(image.shape[-1]))
    was_training = model.training
    model.eval()
    try:
        with recording_layers(model):
            dtype = next(model.parameters()).dtype
            batch = ImageBatch.from_images([tensor.to(model_device(model), dtype)])
            outputs = model(batch)
    finally:
        model.train(was_training)
    corners = outputs["layer_corners"][:, 0].detach().cpu()  # (layers, Q, 4 (R + 1))
    bins = decoder.bin_values(corners.dtype)
    num_layers, num_queries = corners.shape[:2]
    probabilities = corners.reshape(num_layers, num_queries, 4, bins.shape[0]).softmax(-1)
    offsets = probabilities @ bins
    h0, w0 = original_size
    pixels = torch.tensor([w0, h0, w0, h0], dtype=corners.dtype)

    def to_pixels(boxes: Tensor) -> Tensor:
        return box_cxcywh_to_xyxy(boxes[0].detach().cpu().to(corners.dtype)) * pixels

    boxes, references = to_pixels(outputs["pred_boxes"]), to_pixels(outputs["ref_points"])
    detections = []
    for query, cls, score in _top_queries(outputs["pred_logits"][0].detach().cpu(), top_k):
        label = int(category_ids[cls]) if category_ids is not None else cls
        detections.append(LayerDistributions(
            query=query, score=score, label=label, box=boxes[query],
            reference=references[query], probabilities=probabilities[:, query],
            offsets=offsets[:, query]))
    logger.info("edge distributions of %d detections over %d decoder layers",
                len(detections), num_layers)
    return EdgeDistributions(bins=bins, reg_scale=float(decoder.reg_scale.detach().abs()),
                             layers=tuple(range(num_layers)), detections=detections,
                             outputs=outputs, original_size=original_size)


def layer_colours(count: int) -> list[tuple[float, ...]]:
    """One colour per layer, light (the first) to dark (the last)."""
    cmap = colormaps[LAYER_CMAP]
    if count == 1:
        return [cmap(1.0)]
    return [cmap(LIGHTEST + (1.0 - LIGHTEST) * i / (count - 1)) for i in range(count)]


def _crop(ax, image: InputImage, detection: LayerDistributions) -> None:
    """The image around the detection: its box (class colour) and reference box (dashed)."""
    h0, w0 = image.original_size
    ax.imshow(image.display)
    colour = class_colour(detection.label)
    for box, gid, style in [(detection.reference, f"reference:{detection.query}", "--"),
                            (detection.box, f"box:{detection.query}", "-")]:
        x1, y1, x2, y2 = (float(v) for v in box)
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, linestyle=style,
                               edgecolor="white" if style == "--" else colour,
                               linewidth=1.4 if style == "--" else 2.0, gid=gid))
    both = torch.stack([detection.box, detection.reference]).float()
    x1, y1 = float(both[:, 0].min()), float(both[:, 1].min())
    x2, y2 = float(both[:, 2].max()), float(both[:, 3].max())
    grow = CROP_MARGIN * max(x2 - x1, y2 - y1, 1.0)
    left, right = max(x1 - grow, 0.0), min(x2 + grow, float(w0))
    top, bottom = max(y1 - grow, 0.0), min(y2 + grow, float(h0))
    if right <= left or bottom <= top:  # boxes off the image: show all of it
        left, right, top, bottom = 0.0, float(w0), 0.0, float(h0)
    ax.set_xlim(left, right)
    ax.set_ylim(bottom, top)
    hide_ticks(ax)


def _edge_panel(ax, record: EdgeDistributions, detection: LayerDistributions, edge: int,
                colours: Sequence) -> None:
    bins = record.bins.double().numpy()
    probs = detection.probabilities[:, edge].double().numpy()
    offsets = detection.offsets[:, edge].double().numpy()
    pixels = detection.offset_pixels(record.reg_scale)[:, edge].double().numpy()
    for i, layer in enumerate(record.layers):
        ax.plot(bins, probs[i], color=colours[i], linewidth=1.3, marker=".", markersize=3,
                gid=f"distribution:{detection.query}:{EDGES[edge]}:{layer}")
        ax.axvline(offsets[i], color=colours[i], linestyle="--", linewidth=1.0,
                   gid=f"offset:{detection.query}:{EDGES[edge]}:{layer}")
    ax.axvline(0.0, color="0.6", linewidth=0.6, zorder=0)
    ax.set_xlim(float(bins[0]), float(bins[-1]))
    ax.set_ylim(0.0, max(float(probs.max()) * 1.1, 1e-3))
    size = "width" if edge in (0, 2) else "height"
    ax.set_xlabel(f"W(n): edge offset in ref. {size} / {record.reg_scale:g} (+ = outwards)",
                  fontsize=7)
    ax.set_ylabel("bin probability", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.set_title(f"{EDGES[edge]}: d = {offsets[-1]:+.3f} ({pixels[-1]:+.1f} px)", fontsize=8)


def plot_edge_distributions(
    image: InputImage,
    record: EdgeDistributions,
    category_names: Mapping[int, str] | Sequence[str] | None = None,
    out: str | Path | None = None,
    title: str | None = None,
) -> Figure:
    """One row per detection of ``record``: the image around it, then its four edges'
    distributions through the layers (module docstring).

    Args:
        image: the picture the record was computed for (its original pixels).
        record: :func:`edge_distributions` of the model on ``image``.
        category_names: id -> name (or a list) for the row titles.
    """
    if len(record.detections) > MAX_TOP_K:
        raise ValueError(f"{len(record.detections)} detections: one figure draws at most "
                         f"{MAX_TOP_K} (a row each)")
    rows = max(len(record.detections), 1)
    fig, axes = new_figure(rows, 1 + len(EDGES), panel_size=(3.0, 2.4))
    colours = layer_colours(len(record.layers))
    if not record.detections:
        for ax in axes[0]:
            ax.set_axis_off()
    for row, detection in zip(axes, record.detections):
        _crop(row[0], image, detection)
        row[0].set_title(f"query {detection.query}: "
                         f"{category_name(detection.label, category_names)} "
                         f"{detection.score:.2f}", fontsize=8)
        for edge in range(len(EDGES)):
            _edge_panel(row[edge + 1], record, detection, edge, colours)
    handles = [Line2D([], [], color=c, linewidth=1.3, label=f"layer {layer}")
               for c, layer in zip(colours, record.layers)]
    handles.append(Line2D([], [], color="0.3", linestyle="--", linewidth=1.0,
                          label="offset (sum p W)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=7)
    fit_suptitle(fig, title or (
        f"{image.name}: per-edge box distributions of the {len(record.detections)} best "
        f"detections through decoder layers {record.layers[0]}..{record.layers[-1]} (FDR); "
        "image: box solid, reference dashed"), fontsize=10)
    save_figure(fig, out)
    return fig
