"""The DEIMv2 positions grids (issue 49; docs/ablations.md, "DEIMv2: where should the
positions be?"): ``encodings_deimv2`` (the published DEIMv2-S fine-tuned with each backbone
encoding x each encoder encoding, SLURM) and ``demo_encodings_deimv2`` (the CPU demo
DEIMv2 from scratch). Their rows differ only in ``model.encodings.backbone`` /
``model.encodings.encoder``; the COCO grid's runs are submit jobs fine-tuning the
published file on the published fine-tuning schedule; and two of its rows run at tiny
scale: a published-like file (random weights in the official solver's layout) fine-tuned
into the ViT without RoPE and with a learned embedding, then evaluated at the grid's
sizes and canvases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from detr_irpe.ablation import collect_and_write, load_grid, schedule
from detr_irpe.cli import submit as submit_tool
from detr_irpe.cli import train as train_tool
from detr_irpe.config import load_config
from detr_irpe.run_folder.status import RunState, run_state

IRPE = "rpe-2.0-product-ctx-1-k"
BACKBONE = {"rope-dinov3": ["rope-dinov3"], "none": [], "rope-axial": ["rope-axial"],
            "rope-mixed": ["rope-mixed"], "irpe": [IRPE], "learned": ["learned"]}
ENCODER = {"sine": ["sine"], "none": [], IRPE: [IRPE]}
# the published fine-tuning recipe of DEIMv2-S (the official README's 20 + 12 epochs)
FINE_TUNING = {"train.epochs": 32, "train.lr_flat_epochs": 14, "train.lr_no_aug_epochs": 12,
               "data.aug_policy_epochs": [4, 14, 20], "data.mixup_epochs": [4, 14],
               "data.copyblend_epochs": [4, 20], "data.batch_scales_stop_epoch": 20,
               "loss.matcher_change_epoch": 18}


def _row(name: str) -> tuple[list[str], list[str]]:
    """``(backbone, encoder)`` encodings of the row named ``backbone,encoder=...``."""
    backbone, encoder = name.split(",encoder=")
    return BACKBONE[backbone], ENCODER[encoder]


def _value(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize(("name", "base", "rows", "seeds"), [
    # the COCO grid: every backbone encoding x every encoder encoding
    ("encodings_deimv2", "deimv2_s", [f"{b},encoder={e}" for b in BACKBONE for e in ENCODER],
     [42]),
    # the CPU grid: the backbone's three encodings with the AIFI's sine, and the published
    # backbone without an AIFI encoding
    ("demo_encodings_deimv2", "synthetic_demo_deimv2",
     ["rope-dinov3,encoder=sine", "none,encoder=sine", "irpe,encoder=sine",
      "rope-dinov3,encoder=none"], [42, 7, 1]),
])
def test_rows_differ_only_in_the_encodings(name: str, base: str, rows: list[str],
                                           seeds: list[int]) -> None:
    """Each row is the base config with the grid's common overrides and its two encoding
    keys, nothing else; the baseline row is the published model's encodings."""
    grid = load_grid(name)
    assert [v.name for v in grid.variants] == rows
    assert grid.seeds == seeds and grid.baseline == "rope-dinov3,encoder=sine"
    assert grid.base.name == f"{base}.yaml" and len(grid.runs) == len(grid.variants) * len(seeds)
    for run in grid.runs:
        backbone, encoder = _row(run.variant.name)
        assert run.config.model.encodings == {"backbone": backbone, "encoder": encoder}
        expected = load_config(base, [
            *grid.overrides, f"model.encodings.backbone={backbone}",
            f"model.encodings.encoder={encoder}", f"train.seed={run.seed}",
            f"train.output_dir={run.output_dir}"])
        assert run.config.to_dict() == expected.to_dict(), run.variant.name
    # the baseline row is the base config's own model (its default encodings)
    baseline = next(r for r in grid.runs if r.variant.name == grid.baseline)
    own = load_config(base, list(grid.overrides))
    assert baseline.config.to_dict()["model"] == own.to_dict()["model"]
    data = baseline.config.data
    sizes = [s.short for s in grid.eval_sizes if s.short]
    assert min(sizes) < data.eval_size < max(sizes) and data.eval_size in sizes
    assert min(sizes) < min(data.batch_scales) and max(sizes) > max(data.batch_scales)
    assert {"mosaic1x1", "mosaic2x2", "pad2x2-c"} <= {c.label for c in grid.eval_canvases}


def test_the_coco_grid_fine_tunes_the_published_file_on_slurm() -> None:
    """One submit job of 4 GPUs per run, each fine-tuning the published DEIMv2-S file (zoo
    name deimv2_s) on the published fine-tuning schedule, with the iRPE tables at zero,
    and evaluating at the grid's sizes and canvases."""
    grid = load_grid("encodings_deimv2")
    assert grid.launcher == "slurm" and grid.nproc_per_node == 4 and grid.finetune == "deimv2_s"
    assert len(grid.runs) == 18
    for run in grid.runs:
        assert {key: _value(run.config, key) for key in FINE_TUNING} == FINE_TUNING
        assert run.config.model.rpe_init == "zero" and run.config.model.size == "s"
        command = schedule.launch_command(grid, run)
        args, rest = submit_tool.build_parser().parse_known_args(command[3:])
        train = train_tool.build_parser().parse_args(rest)
        assert args.gpus_per_node == 4 and args.wait and train.finetune == "deimv2_s"
        assert train.config.endswith("deimv2_s.yaml")
        assert train.sizes == [s.label for s in grid.eval_sizes]
        assert train.canvases == [c.label for c in grid.eval_canvases]


def test_the_demo_grid_is_the_demo_deimv2_from_scratch() -> None:
    grid = load_grid("demo_encodings_deimv2")
    assert grid.launcher == "local" and grid.finetune is None
    assert grid.synthetic_data == {"num_train": 1600, "num_val": 200, "seed": 0}
    cfg = grid.runs[0].config
    # float32: the same numbers on every CPU kind (bf16 only where the CPU has it)
    assert (cfg.model.family, cfg.model.backbone, cfg.train.epochs, cfg.train.amp) == (
        "deimv2", "vit_tiny", 10, "none")
    assert cfg.train.lr_drop == 9 and cfg.train.eval_every == cfg.train.epochs
    # the matcher switches inside the demo's schedule, as the published one in its own
    assert 0 < cfg.loss.matcher_change_epoch < cfg.train.epochs


# ----------------------------------------------------------------------------- tiny scale
# The COCO grid's rows at test size: deimv2_tiny instead of DEIMv2-S, the tiny dataset,
# one epoch at a learning rate of 1e-12 (the fine-tuned weights stay the published ones),
# then the scheduler's evaluation at the shipped sizes (up to 1280 px) and canvases.
_TINY = ("train.epochs=1", "train.lr_flat_epochs=0", "train.lr_no_aug_epochs=0",
         "train.batch_size=4", "train.num_threads=1", "train.lr=1e-12", "train.lr_backbone=0",
         "train.ema.enabled=false", "data.eval_size=64", "data.train_size=64",
         "data.batch_scales=[48, 64, 80]")
# anchors of a published file's eval size (64 px here: 8 x 8 + 4 x 4 + 2 x 2 tokens)
_ANCHORS = 64 + 16 + 4


def _official_file(state: dict[str, torch.Tensor], path: Path) -> Path:
    """``state`` as the published solver saves it: the EMA's weights in ``ema.module``,
    the anchors of its eval size."""
    anchors = torch.zeros(1, _ANCHORS, 4)
    published = {**state, "decoder.anchors": anchors,
                 "decoder.valid_mask": torch.ones(1, _ANCHORS, 1, dtype=torch.bool)}
    torch.save({"model": published, "ema": {"module": published, "updates": 10}}, path)
    return path


@pytest.mark.slow
def test_two_rows_fine_tune_a_published_file_at_tiny_scale(tiny_dataset: Path,
                                                           tmp_path: Path) -> None:
    from detr_irpe.engine.runner import run_training
    from detr_irpe.models import build_model

    torch.manual_seed(3)
    published = build_model(load_config("deimv2_tiny", ["model.num_classes=80"]),
                            load_backbone_weights=False)[0].state_dict()
    weights = _official_file(published, tmp_path / "deimv2_tiny_coco.pth")
    grid_file = tmp_path / "grid.yaml"
    keys = {"_base_": str(load_grid("encodings_deimv2").path), "finetune": str(weights),
            "launcher": "local", "nproc_per_node": 1, "submit": [],
            "variants": [{"name": "none", "overrides": ["model.encodings.backbone=[]"]},
                         {"name": "learned",
                          "overrides": ["model.encodings.backbone=[learned]"]}],
            "axes": {"model.encodings.encoder": ["sine"]}, "baseline": "none,encoder=sine"}
    grid_file.write_text(yaml.safe_dump(keys))
    grid = load_grid(grid_file, [f"data.root={tiny_dataset}", *_TINY], str(tmp_path / "out"),
                     seeds=[42], base="deimv2_tiny")
    assert [r.config.model.encodings["backbone"] for r in grid.runs] == [[], ["learned"]]
    for run in grid.runs:
        run_training(run.config, finetune=grid.finetune, progress=False)
    assert {run_state(r.output_dir, r.config) for r in grid.runs} == {RunState.FINISHED}
    # the published ViT under another encoding: its weights kept, RoPE's periods gone, the
    # learned embedding (new) at zero
    vit = "backbone.dinov3._model.blocks.0.attn.qkv.weight"
    for run in grid.runs:
        trained = torch.load(run.output_dir / "checkpoint_last.pth", weights_only=True)["model"]
        torch.testing.assert_close(trained[vit], published[vit], rtol=0, atol=1e-6)
        assert not any("rope_embed" in k for k in trained)
        learned = [k for k in trained if k.endswith("pos_embed")]
        assert len(learned) == (run.variant.name.startswith("learned"))
        for key in learned:
            assert float(trained[key].abs().max()) <= 1e-6
    report = schedule.evaluate_grid_sizes(grid)
    assert report.sizes_done == grid.runs and not report.sizes_failed
    rows, paths = collect_and_write(grid)
    md = paths["markdown"].read_text()
    assert "## AP (%) on canvases" in md and "## AP (%) at test sizes" in md
    for row in rows:
        assert row.canvas_seeds == 1 == row.size_seeds
        assert all(row.canvas_stats[c.label]["AP"] is not None for c in grid.eval_canvases)
        assert all(row.size_stats[s.label]["AP"] is not None for s in grid.eval_sizes)
