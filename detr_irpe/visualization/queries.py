"""RT-DETR's query selection over the image: the encoder proposals the decoder started from.

RT-DETR scores every token of its multi-scale memory as a proposal (a class score and a
box refined from the token's anchor) and keeps the ``Q`` of highest best-class score as
the decoder's queries (IoU-aware query selection, Zhao et al., CVPR 2024, Sec. 4.3). Its
eval-mode outputs carry them: ``enc_topk_boxes`` ``(B, Q, 4)`` (cx, cy, w, h relative to
the un-padded image) and ``enc_topk_logits`` ``(B, Q, C)``.

:func:`plot_selected_queries` draws those boxes over the image, coloured by their score
(sigmoid of the best class) on one colour bar, the best on top. Every box patch carries
the ``gid`` ``query:<index>`` (the query's index in the outputs), so a figure's content
can be read back from its matplotlib objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor

from detr_irpe.data.inputs import InputImage
from detr_irpe.errors import ConfigError
from detr_irpe.models.box_ops import box_cxcywh_to_xyxy

from ._mpl import fit_suptitle, hide_ticks, new_figure, save_figure

__all__ = ["has_selected_queries", "plot_selected_queries", "selected_queries"]

# the colour map of the proposal scores
SCORE_CMAP = "viridis"


def has_selected_queries(outputs: Mapping[str, object]) -> bool:
    """True for outputs that carry the selected proposals (RT-DETR in eval mode)."""
    return "enc_topk_boxes" in outputs and "enc_topk_logits" in outputs


def selected_queries(outputs: Mapping[str, Tensor], original_size: tuple[int, int],
                     batch_index: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(boxes (Q, 4) x1 y1 x2 y2 in original-image pixels, scores (Q,))`` of the selected
    proposals of one image, in query order; a score is the best class's sigmoid.

    Raises:
        ConfigError: the outputs carry no selected proposals (not an RT-DETR in eval mode).
    """
    if not has_selected_queries(outputs):
        raise ConfigError("the selected-queries figure needs a detector with query selection "
                          "(RT-DETR, model.family=rtdetr); this model's outputs have no "
                          "enc_topk_boxes")
    boxes = outputs["enc_topk_boxes"][batch_index].detach().float().cpu()
    scores = outputs["enc_topk_logits"][batch_index].detach().float().cpu().sigmoid().max(-1)
    h0, w0 = original_size
    xyxy = box_cxcywh_to_xyxy(boxes) * torch.tensor([w0, h0, w0, h0])
    return xyxy.numpy(), scores.values.numpy()


def plot_selected_queries(
    image: InputImage,
    outputs: Mapping[str, Tensor],
    out: str | Path | None = None,
    batch_index: int = 0,
    max_queries: int | None = None,
    title: str | None = None,
) -> Figure:
    """The selected proposals' boxes over the image, coloured by score.

    Args:
        image: the picture (boxes are drawn in its original pixels).
        outputs: the model's eval-mode outputs (``enc_topk_boxes``, ``enc_topk_logits``).
        max_queries: draw only this many, the best-scoring (None: all ``Q``).
    """
    boxes, scores = selected_queries(outputs, image.original_size, batch_index)
    order = np.argsort(-scores, kind="stable")[:max_queries]
    h0, w0 = image.original_size
    fig, axes = new_figure(1, 1, panel_size=(8.0, 8.0 * h0 / w0))
    ax = axes[0][0]
    ax.imshow(image.display.mean(axis=2), cmap="gray", vmin=0, vmax=255)
    low = float(scores[order].min()) if len(order) else 0.0
    high = float(scores[order].max()) if len(order) else 1.0
    norm = Normalize(vmin=low, vmax=high if high > low else low + 1e-6)
    cmap = colormaps[SCORE_CMAP]
    for index in order[::-1]:  # worst first: the best ends up on top
        x1, y1, x2, y2 = (float(v) for v in boxes[index])
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, linewidth=1.6,
                               edgecolor=cmap(norm(float(scores[index]))),
                               gid=f"query:{int(index)}"))
    ax.set_xlim(0, w0)
    ax.set_ylim(h0, 0)
    hide_ticks(ax)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.8,
                       label="proposal score (sigmoid of the best class)")
    bar.ax.tick_params(labelsize=7)
    shown = len(order)
    total = len(scores)
    fit_suptitle(fig, title or f"{image.name}: {shown} of the {total} selected queries "
                               "(encoder proposals, top-k by class score)", fontsize=10)
    save_figure(fig, out)
    return fig
