"""See what the model attends to: attention maps, iRPE buckets and tables, predictions, curves.

Everything renders headless to PNG (matplotlib ``Figure`` objects on the Agg canvas, no
pyplot). Submodules are imported lazily, so ``import detr_irpe.visualization`` is cheap.

- capture: :func:`capture_attention` (hooks, no change to the model's forward) ->
  :class:`AttentionRecord`; :func:`pixel_to_token`. Images come in as
  :func:`detr_irpe.data.inputs.prepare_image` makes them, models as
  :func:`detr_irpe.models.model_from_checkpoint` builds them.
- over an image: :func:`plot_predictions`, :func:`plot_encoder_attention`,
  :func:`plot_rpe_contribution`, :func:`plot_decoder_attention`;
  :func:`save_attention_maps` writes them all for one image.
- DAB-DETR / DN-DETR anchors: :func:`plot_anchor_attention` (a query's cross-attention
  with the anchor box its layer started from), :func:`plot_anchor_refinement` (the
  anchors through the decoder layers); :func:`anchor_boxes`.
- RT-DETR's query selection: :func:`plot_selected_queries` (the encoder proposals the
  decoder started from, coloured by score).
- D-FINE / DEIM's Fine-grained Distribution Refinement: :func:`edge_distributions` (per
  detection, each edge's distribution over the bins in every decoder layer, and its
  offset), :func:`plot_edge_distributions`.
- iRPE: :func:`plot_bucket_layout`, :func:`plot_rpe_tables`.
- relative-position response (iRPE and RoPE side by side): :func:`position_responses`,
  :func:`plot_position_response`.
- training: :func:`plot_training_curves` from DETR-format ``log.txt`` files.
- evaluation: :func:`plot_pr_curves` from a ``precision.npz``; :func:`plot_ap_by_size`
  (AP against the test size, ``tools/eval.py --sizes``).
- into pixels: :func:`draw_detections` (labelled boxes drawn into an image tensor, for
  ``predict``), near-duplicates suppressed for drawing only.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "AttentionRecord": "attention",
    "capture_attention": "attention",
    "record_attention_inputs": "attention",
    "pixel_to_token": "attention",
    "token_to_cell": "attention",
    "model_device": "attention",
    "Detections": "figures",
    "detections_from_outputs": "figures",
    "plot_predictions": "figures",
    "plot_encoder_attention": "figures",
    "plot_rpe_contribution": "figures",
    "plot_decoder_attention": "figures",
    "anchor_boxes": "anchors",
    "has_anchors": "anchors",
    "plot_anchor_attention": "anchors",
    "plot_anchor_refinement": "anchors",
    "has_selected_queries": "queries",
    "plot_selected_queries": "queries",
    "selected_queries": "queries",
    "EdgeDistributions": "distributions",
    "LayerDistributions": "distributions",
    "edge_distributions": "distributions",
    "has_edge_distributions": "distributions",
    "plot_edge_distributions": "distributions",
    "recording_layers": "distributions",
    "attention_support": "attention",
    "bucket_layout": "irpe_plots",
    "plot_bucket_layout": "irpe_plots",
    "rpe_table_maps": "irpe_plots",
    "model_rpe_table_maps": "irpe_plots",
    "plot_rpe_tables": "irpe_plots",
    "position_responses": "position_response",
    "encoder_position_responses": "position_response",
    "plot_position_response": "position_response",
    "plot_training_curves": "curves",
    "save_attention_maps": "maps",
    "plot_pr_curves": "pr_curves",
    "pr_curve_series": "pr_curves",
    "draw_detections": "draw",
    "suppress_duplicates": "draw",
    "plot_ap_by_size": "sizes",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY)
