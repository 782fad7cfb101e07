"""The program of ``detr-irpe-visualize`` (:mod:`detr_irpe.cli.visualize`) once its
arguments are parsed: the figure of each subcommand, written as PNG files."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch import nn

import detr_irpe.visualization as vis
from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli.common import check_resize_flags, checked_overrides
from detr_irpe.config import Config, load_config
from detr_irpe.data.categories import resolve_category_names
from detr_irpe.data.inputs import InputImage, prepare_image
from detr_irpe.errors import ConfigError
from detr_irpe.evaluation import load_pr_arrays
from detr_irpe.evaluation.pr_arrays import find_pr_arrays
from detr_irpe.family import families, family_of_model
from detr_irpe.models import build_model, model_from_checkpoint
from detr_irpe.resize import resize_rule
from detr_irpe.structures import ImageBatch
from detr_irpe.utils.device import resolve_device
from detr_irpe.utils.files import ensure_writable_folder
from detr_irpe.visualization.attention import model_device
from detr_irpe.visualization.canvas_encoder import canvas_views, plot_canvas_encoder_views
from detr_irpe.visualization.maps import distinct_points

logger = logging.getLogger(__name__)


def _load(args: argparse.Namespace) -> tuple[nn.Module, Config, dict[int, str] | None]:
    """``(model in eval mode, cfg, category names saved with it)``: the checkpoint's model
    (:func:`~detr_irpe.models.model_from_checkpoint`), or without one the config's model
    with random weights, to look at its geometry."""
    overrides = checked_overrides(args.overrides)
    device = resolve_device(args.device)
    if args.checkpoint is not None:
        source = resolve_checkpoint(args.checkpoint)
        config = args.config if args.config is not None else source.config
        loaded = model_from_checkpoint(source.path, config, overrides, device,
                                       trust_imports=args.trust_imports)
        return loaded.model, loaded.cfg, loaded.category_names
    cfg = load_config(args.config, overrides)
    if cfg.model.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set and there is no checkpoint to take it from; "
            "pass e.g. --set model.num_classes=91"
        )
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    logger.warning("no checkpoint: the model has random weights")
    return model.to(device).eval(), cfg, None


def _image_run(args: argparse.Namespace
               ) -> tuple[nn.Module, InputImage, dict[int, str] | None, list[int] | None]:
    """Model, prepared image, category names, the category id of each class output
    (``model.category_ids``: None when the class indices are the ids)."""
    check_resize_flags(args.size, args.max_size)  # before the model is loaded
    model, cfg, stored_names = _load(args)
    # the evaluation input of the config's resize rule (RT-DETR's: eval_size squares)
    # unless --size asks for a shorter side
    image = prepare_image(args.image, **resize_rule(cfg).image_input(args.size),
                          max_size=args.max_size or cfg.data.max_size,
                          max_pixels=cfg.data.max_image_pixels)
    names = resolve_category_names(cfg, stored_names, args.names)
    return model, image, names, cfg.model.category_ids


def _rpe_tables(args: argparse.Namespace, default_dir: Path) -> list[Path]:
    model, cfg, _ = _load(args)
    out = args.out or default_dir / "rpe_tables.png"
    maps = vis.model_rpe_table_maps(model, extent=args.extent, layers=args.layers)
    vis.plot_rpe_tables(maps, out=out, per_head=args.per_head,
                        title=f"iRPE tables ({cfg.model.rpe}) on the offset grid")
    return [out]


def _position_response(args: argparse.Namespace, default_dir: Path) -> list[Path]:
    model, cfg, _ = _load(args)
    out = args.out or default_dir / "position_response.png"
    responses = vis.encoder_position_responses(model, layer=args.layer, extent=args.extent)
    vis.plot_position_response(
        responses, out=out, per_head=args.per_head,
        title=f"encoder layer {args.layer}: the logit term of each position encoding "
              f"({cfg.model.place('encoder').describe()}) for a key at offset (dy, dx)")
    return [out]


def _pr_curves(args: argparse.Namespace) -> list[Path]:
    found = find_pr_arrays(args.source)
    arrays = load_pr_arrays(found)
    out = args.out or found.with_name("pr_curves.png")
    vis.plot_pr_curves(arrays, out=out, iou_thresholds=args.iou, area=args.area,
                   max_dets=args.max_dets, classes=args.classes)
    return [out]


def available_figures(model: nn.Module) -> list[str]:
    """The image figures ``model`` offers: predictions, the attention figures of the
    modules its family names, and the family's own (``DetectorFamily.figures``)."""
    family = family_of_model(model)
    kinds = ["predictions"]
    if family is not None and family.attention is not None:
        unwrapped = getattr(model, "module", model)
        if family.attention.encoder(unwrapped):
            kinds.append("encoder-attention")
        if family.attention.decoder(unwrapped):
            kinds.append("decoder-attention")
    return kinds + list(family.figures if family is not None else ())


def _check_figure(model: nn.Module, figure: str) -> None:
    """Refuse, in one line, a figure the model's family does not offer."""
    kinds = available_figures(model)
    if figure in kinds:
        return
    family = family_of_model(model)
    who = (f"{family.title} (model.family={family.name})" if family is not None
           else type(model).__name__)
    why = ""
    if figure == "decoder-attention" and family is not None and family.attention is not None:
        why = f" ({family.attention.no_decoder_figure})"
    offered_by = [f"{other.title}, model.family={other.name}" for other in families()
                  if figure in other.figures]
    if offered_by:
        why += f" (a figure of {'; '.join(offered_by)})"
    raise ConfigError(f"{figure}: {who} has no such figure{why}; its figures: "
                      f"{', '.join(kinds)}")


def _image_figure(args: argparse.Namespace, default_dir: Path) -> list[Path]:
    """predictions, encoder-attention (+ iRPE split), decoder-attention, or the dab
    decoder's anchor-attention / anchors of one image."""
    if args.out is not None:
        # before the model is loaded
        ensure_writable_folder(args.out.parent, "output folder", "choose another --out")
    model, image, names, category_ids = _image_run(args)
    _check_figure(model, args.command)
    family = family_of_model(model)
    inputs = [image.tensor.to(model_device(model))]
    record = None
    with torch.no_grad():
        if args.command in ("predictions", "anchors", "selected-queries"):
            outputs = model(ImageBatch.from_images(inputs))
        else:
            encoder = args.command == "encoder-attention"
            record = vis.capture_attention(
                model, inputs, encoder_layers=[args.layer] if encoder else "none",
                decoder_layers="none" if encoder else [args.layer],
                rpe_split=getattr(args, "rpe_contribution", False),
            )
            outputs = record.outputs
    detections = vis.detections_from_outputs(
        outputs, image.original_size, threshold=args.threshold,
        max_detections=args.max_detections, min_detections=args.min_detections,
        category_ids=category_ids, sigmoid=family.sigmoid_classes if family else None)
    logger.info("%d detections kept (score >= %s)", len(detections),
                                     args.threshold)
    out = args.out or default_dir / f"{image.name}_{args.command.replace('-', '_')}.png"
    if args.command == "predictions":
        vis.plot_predictions(image, detections, names, out=out)
        return [out]
    if args.command == "decoder-attention":
        vis.plot_decoder_attention(image, record, detections, names, layer=args.layer, out=out)
        return [out]
    if args.command == "anchor-attention":
        vis.plot_anchor_attention(image, record, detections, names, layer=args.layer, out=out)
        return [out]
    if args.command == "anchors":
        vis.plot_anchor_refinement(image, outputs, detections, names, out=out)
        return [out]
    if args.command == "selected-queries":
        vis.plot_selected_queries(image, outputs, out=out, max_queries=args.max_queries)
        return [out]
    points = args.points or distinct_points(detections.centres(), image, record,
                                            limit=args.num_points)
    if not points:
        h0, w0 = image.original_size
        points = [(w0 / 2.0, h0 / 2.0)]
        logger.warning(
            "no detection kept: using the image centre as reference point")
    vis.plot_encoder_attention(image, record, points, layer=args.layer, out=out,
                               heads=args.heads)
    written = [out]
    if args.rpe_contribution:
        rpe_out = out.with_name(out.stem + "_rpe_contribution.png")
        vis.plot_rpe_contribution(image, record, points, layer=args.layer, out=rpe_out)
        written.append(rpe_out)
    return written


def _distributions(args: argparse.Namespace, default_dir: Path) -> list[Path]:
    """``distributions``: the edge distributions of the ``--top-k`` best detections."""
    if args.out is not None:
        # before the model is loaded
        ensure_writable_folder(args.out.parent, "output folder", "choose another --out")
    model, image, names, category_ids = _image_run(args)
    record = vis.edge_distributions(model, image, top_k=args.top_k, category_ids=category_ids)
    out = args.out or default_dir / f"{image.name}_distributions.png"
    vis.plot_edge_distributions(image, record, names, out=out)
    return [out]


def _all(args: argparse.Namespace, default_dir: Path) -> list[Path]:
    """``all``: the figures of :func:`~detr_irpe.visualization.save_attention_maps` (the
    family's own included) of one model loaded once."""
    model, image, names, category_ids = _image_run(args)
    paths = vis.save_attention_maps(model, image, args.out_dir or default_dir,
                                    category_names=names, category_ids=category_ids,
                                    threshold=args.threshold, layer=args.layer,
                                    prefix=f"{image.name}_", distributions_top_k=args.top_k)
    return list(paths.values())


def _canvas_encoder(args: argparse.Namespace, default_dir: Path) -> list[Path]:
    """``canvas-encoder``: one row per config, its model with random weights (the
    encodings are fixed functions of the grid) on one random square image."""
    if args.size < 32:
        raise ConfigError(f"--size {args.size}: at least 32 pixels (one stride-32 cell)")
    image = torch.randn(3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.configs:
        # the class count does not touch the encoder: any will do when the config has none
        cfg = load_config(name, ["model.backbone_weights=none"])
        if cfg.model.num_classes is None:
            cfg = load_config(name, ["model.backbone_weights=none", "model.num_classes=2"])
        model = build_model(cfg, load_backbone_weights=False)[0]
        rows.append((Path(name).stem, canvas_views(model, image)))
    out = args.out or default_dir / "canvas_encoder.png"
    plot_canvas_encoder_views(rows, out)
    return [out]


def run(args: argparse.Namespace, default_dir: Path) -> list[Path]:
    """Draw what ``args.command`` asks for (``--min-detections`` resolved by the tool);
    the PNG files written, by default into ``default_dir``."""
    if args.command == "buckets":
        out = args.out or default_dir / f"buckets_ratio{args.ratio:g}.png"
        vis.plot_bucket_layout(args.ratio, tuple(args.grid), args.point, args.methods, out=out)
        return [out]
    if args.command == "curves":
        out = args.out or default_dir / "curves.png"
        vis.plot_training_curves(args.logs, out=out, labels=args.labels)
        return [out]
    if args.command == "pr-curves":
        return _pr_curves(args)
    if args.command == "canvas-encoder":
        return _canvas_encoder(args, default_dir)
    if args.command == "rpe-tables":
        return _rpe_tables(args, default_dir)
    if args.command == "position-response":
        return _position_response(args, default_dir)
    if args.command == "all":
        return _all(args, default_dir)
    if args.command == "distributions":
        return _distributions(args, default_dir)
    return _image_figure(args, default_dir)


__all__ = ["available_figures", "run"]
