"""What the encoder attention of a model sees on a canvas (docs/evaluation.md,
"Canvases"): the absolute position encoding added to its queries and keys, and the
padding mask it gets, for one image three ways: alone, padded by a batch next to an
image twice as large (the padding masked), and placed on a canvas twice its size (the
canvas is a real image: nothing masked).

Family-generic: the first encoder attention module the family registers
(``DetectorFamily.attention.encoder``) is hooked; the encodings add ``pos`` to the
queries and keys and not to the values (``q = k = x + pos``, ``v = x``), so ``q - v`` is
the encoding each token gets (zero for a model without an absolute encoding: RoPE and
iRPE act inside the attention, on relative offsets).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.data.loader import collate_fn
from detr_irpe.family import family_of_model

from ._mpl import new_figure, save_figure

__all__ = ["encoder_view", "plot_canvas_encoder_views", "canvas_views"]


def encoder_view(model: nn.Module, images: Sequence[Tensor]) -> dict[str, Tensor]:
    """The first encoder attention's inputs for a batch of ``(3, H_i, W_i)`` images
    (zero-padded and masked as the data loader does): ``{"pos": (B, h, w, C)`` the
    absolute encoding (``query - value``), ``"mask": (B, h, w)`` True where the
    attention ignores a key (all False without a mask)}``."""
    family = family_of_model(model)
    modules = family.attention.encoder(model) if family and family.attention else []
    if not modules:
        raise ValueError("the model's family registers no encoder attention module to hook")
    seen: dict[str, Any] = {}

    def hook(module, args, kwargs):
        names = ("query", "key", "value", "hw", "key_padding_mask")
        values = dict(zip(names, args)) | kwargs
        seen.update({k: values.get(k) for k in names})

    handle = modules[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        batch, _ = collate_fn([(image, {}) for image in images])
        with torch.no_grad():
            model.eval()(batch)
    finally:
        handle.remove()
    height, width = seen["hw"]
    query, value = seen["query"], seen["value"]
    skip = query.shape[1] - height * width
    pos = (query - value)[:, skip:].reshape(len(images), height, width, -1)
    mask = seen["key_padding_mask"]
    mask = (torch.zeros(len(images), height, width, dtype=torch.bool) if mask is None
            else mask[:, skip:].reshape(len(images), height, width).bool())
    return {"pos": pos, "mask": mask}


def canvas_views(model: nn.Module, image: Tensor) -> dict[str, dict[str, Tensor]]:
    """The encoder's view of ``image`` ``(3, H, W)`` alone, batch-padded next to an image
    ``(3, 2H, 2W)``, and at the top left of a ``2H x 2W`` canvas (the mean colour around it,
    as ``pad2x2-tl``); each ``{"pos": (h, w, C), "mask": (h, w)}``."""
    height, width = image.shape[-2:]
    canvas = F.pad(image, (0, width, 0, height))
    views = {"alone": encoder_view(model, [image]),
             "batch-padded": encoder_view(model, [image, torch.zeros(3, 2 * height, 2 * width)]),
             "canvas": encoder_view(model, [canvas])}
    return {name: {k: v[0] for k, v in view.items()} for name, view in views.items()}


def _channel(pos: Tensor) -> int:
    """The channel that varies most along the width (the x part of an encoding)."""
    return int(pos.diff(dim=1).abs().mean(dim=(0, 1)).argmax())


def plot_canvas_encoder_views(rows: Sequence[tuple[str, dict[str, dict[str, Tensor]]]],
                              out: str | Path | None):
    """One row per model (``(title, canvas_views(...))``), one panel per view: the
    channel of the absolute encoding that varies most along x, over the encoder's token
    grid of the larger input, masked tokens hatched. Returns the figure."""
    names = ("alone", "batch-padded", "canvas")
    fig, axes = new_figure(len(rows), len(names), panel_size=(2.8, 2.6))
    for r, (title, views) in enumerate(rows):
        channel = _channel(views["canvas"]["pos"])
        for c, name in enumerate(names):
            ax, view = axes[r][c], views[name]
            pos = view["pos"][..., channel]
            if float(view["pos"].abs().max()) == 0:
                ax.text(0.5, 0.5, "no absolute encoding\n(q = k = x)", ha="center",
                        va="center", transform=ax.transAxes, fontsize=8)
            else:
                ax.imshow(pos.numpy(), cmap="coolwarm", vmin=-1, vmax=1)
            mask = view["mask"]
            if bool(mask.any()):
                ax.contourf(mask.float().numpy(), levels=[0.5, 1.5], hatches=["//"],
                            colors="none")
            masked = int(mask.sum())
            ax.set_title(f"{title}: {name}\n{tuple(mask.shape)} tokens, {masked} masked",
                         fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    save_figure(fig, out)
    return fig
