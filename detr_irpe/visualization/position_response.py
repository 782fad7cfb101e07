"""The relative-position response of a head: the attention-logit term each position
encoding adds for a key at offset ``(dy, dx) = key - query``, drawn side by side.

Each encoding computes its own term (its registry entry's ``response``, in its module
of :mod:`detr_irpe.encodings`, e.g. :func:`~detr_irpe.encodings.irpe.irpe_response`): iRPE
from the module's bucket ids and tables, a rotary encoding as the rotated content logit of
one query / key vector pair, a plugin's from its own. The query / key vectors ``(h, D)`` are what a caller chooses: e.g. the mean of a
layer's projected queries over an image; the default is the all-ones vector (a data-free
view of the encoding). Offsets are shown as in :mod:`.irpe_plots`: the panel cell at
``(dy, dx)`` is the key at ``key - query``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

from detr_irpe.encodings.model import position_responses as encoding_responses
from detr_irpe.encodings.response import DEFAULT_EXTENT
from detr_irpe.errors import ConfigError

from ._mpl import fit_suptitle, new_figure, save_figure
from .attention import encoder_attention_modules

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_EXTENT", "encoder_position_responses", "plot_position_response",
           "position_responses"]


def position_responses(attn: nn.Module, extent: int | None = None,
                       query: torch.Tensor | None = None,
                       key: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """``{"iRPE": ..., "RoPE-axial": ..., <a plugin's title>: ...}``: every logit-position
    term the attention module has, each ``(h, 2R + 1, 2R + 1)`` on one offset grid."""
    out = encoding_responses(attn, extent, query, key)
    if not out:
        raise ConfigError(f"{type(attn).__name__} has neither iRPE logit tables nor a "
                          "rotary encoding nor a plugin encoding with a figure: its logits "
                          "carry no relative-position term")
    return out


def encoder_position_responses(model: nn.Module, layer: int = 0, extent: int | None = None,
                               query: torch.Tensor | None = None,
                               key: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """:func:`position_responses` of one encoder layer's self-attention of a detector."""
    modules = encoder_attention_modules(model)
    if not modules:
        raise ConfigError("the model has no encoder layers")
    return position_responses(modules[layer % len(modules)], extent, query, key)


def plot_position_response(
    responses: dict[str, np.ndarray],
    out: str | Path | None = None,
    per_head: bool = False,
    title: str | None = None,
) -> Figure:
    """One column per encoding (side by side), one row per head (or one row, the mean of
    the heads); each panel a diverging map centred at 0 over the offset grid.

    Args:
        responses: ``{name: (h, 2R + 1, 2R + 1)}``, e.g. :func:`position_responses`.
        out: PNG path or None.
        per_head: a row per head instead of the mean over heads.
        title: the figure title.
    """
    if not responses:
        raise ConfigError("no position responses to draw")
    names = list(responses)
    heads = max(v.shape[0] for v in responses.values()) if per_head else 1
    fig, axes = new_figure(heads, len(names), panel_size=(3.2, 2.9))
    for c, name in enumerate(names):
        value = responses[name]
        extent = value.shape[-1] // 2
        for r in range(heads):
            ax = axes[r][c]
            if r >= value.shape[0]:
                ax.axis("off")
                continue
            data = value[r] if per_head else value.mean(axis=0)
            vmax = float(np.abs(data).max()) or 1.0
            image = ax.imshow(data, cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                              extent=(-extent - 0.5, extent + 0.5, extent + 0.5, -extent - 0.5))
            ax.plot(0, 0, marker="+", color="black", markersize=8)
            bar = fig.colorbar(image, ax=ax, shrink=0.8, label="logit term")
            bar.ax.tick_params(labelsize=7)
            bar.ax.yaxis.label.set_size(8)
            head_txt = f" head {r}" if per_head else (" (mean of heads)" if value.shape[0] > 1
                                                      else "")
            ax.set_title(f"{name}{head_txt}", fontsize=9)
            if r == heads - 1:
                ax.set_xlabel("dx = key col - query col", fontsize=8)
            if c == 0:
                ax.set_ylabel("dy = key row - query row", fontsize=8)
            ax.tick_params(labelsize=7)
    fit_suptitle(fig, title or "relative-position response: the logit term each encoding "
                               "adds for a key at offset (dy, dx)")
    save_figure(fig, out)
    return fig
