"""detectors.yaml / demo_detectors.yaml: {DETR, DN-DETR, RT-DETR} x {none, iRPE}, each
family on its own base config (a variant's ``base``); the rows are what they say."""

from __future__ import annotations

from detr_irpe.ablation.grid import load_grid
from detr_irpe.ablation.schedule import launch_command
from detr_irpe.config import load_config

IRPE = "rpe-2.0-product-ctx-1-k"
# detectors.yaml's rows and the published configs they must equal
PUBLISHED = {("detr", "none"): "detr_r50", ("detr", IRPE): "detr_r50_irpe",
             ("dn", "none"): "dn_detr_r50", ("dn", IRPE): "dn_detr_r50_irpe",
             ("rtdetr", "none"): "rtdetr_r50", ("rtdetr", IRPE): "rtdetr_r50_irpe"}
FAMILY = {"detr": "detr", "dn": "dab", "rtdetr": "rtdetr"}


def _detector_and_rpe(run) -> tuple[str, str]:
    detector, rpe = run.variant.name.split(",rpe=")
    return detector, rpe


def test_detectors_grid_rows_are_the_published_configs() -> None:
    """Every section of every row (model, loss, data, train) is its published config's,
    but for RT-DETR's per-process batch (2 x 8 processes = the published 16)."""
    grid = load_grid("detectors")
    assert sorted(_detector_and_rpe(run) for run in grid.runs) == sorted(PUBLISHED)
    for run in grid.runs:
        detector, _ = _detector_and_rpe(run)
        extra = ["train.batch_size=2"] if detector == "rtdetr" else []
        expected = load_config(PUBLISHED[_detector_and_rpe(run)], [
            *extra, f"train.seed={run.seed}", f"train.output_dir={run.output_dir}"])
        assert run.config.to_dict() == expected.to_dict(), run.variant.name
        assert run.config.model.family == FAMILY[detector]
    # each run trains from its own base config
    rtdetr = next(run for run in grid.runs if run.variant.name.startswith("rtdetr"))
    command = launch_command(grid, rtdetr)
    assert command[command.index("--config") + 1].endswith("rtdetr_r50.yaml")
    assert grid.nproc_per_node * rtdetr.config.train.batch_size == 16


def test_demo_detectors_grid_rows() -> None:
    """DETR / DN-DETR rows are demo_decoders.yaml's; the RT-DETR rows are the tiny RT-DETR
    at the synthetic data's 128 px on the same data and step budget; within each
    detector only model.rpe differs."""
    grid = load_grid("demo_detectors")
    decoders = {run.variant.name: run.config for run in load_grid("demo_decoders").runs}
    assert sorted(_detector_and_rpe(run) for run in grid.runs) == sorted(PUBLISHED)
    detr = next(run.config for run in grid.runs if run.variant.name == "detr,rpe=none")
    for run in grid.runs:
        detector, rpe = _detector_and_rpe(run)
        cfg = run.config
        assert (cfg.model.family, cfg.model.rpe) == (FAMILY[detector], rpe)
        # the same data, epochs and steps per epoch as the DETR row
        for key in ("root", "train_ann", "val_ann"):
            assert getattr(cfg.data, key) == getattr(detr.data, key)
        assert (cfg.train.epochs, cfg.train.batch_size, cfg.train.eval_every) == (
            detr.train.epochs, detr.train.batch_size, detr.train.eval_every) == (7, 8, 7)
        if detector == "rtdetr":
            assert run.base.name == "rtdetr_tiny.yaml"
            assert (cfg.data.augmentation, cfg.data.train_size, cfg.data.eval_size) == (
                "rtdetr", 128, 128)
            assert (cfg.train.lr_schedule, cfg.train.lr_drop) == ("step", 6)
            # the model and loss of rtdetr_tiny.yaml, only model.rpe set by the axis
            tiny = load_config("rtdetr_tiny", [f"model.rpe={rpe}"]).to_dict()
            assert cfg.to_dict()["model"] == tiny["model"]
            assert cfg.to_dict()["loss"] == tiny["loss"]
        else:
            name = f"{detector},rpe={rpe}"
            mine = cfg.to_dict()
            theirs = decoders[name].to_dict()
            for section in ("model", "loss", "data"):
                assert mine[section] == theirs[section], (name, section)
            mine["train"].pop("output_dir"), theirs["train"].pop("output_dir")
            assert mine["train"] == theirs["train"], name
    # within a detector, only model.rpe (and the encoder list it is a shorthand of) differs
    # between the two rows
    for detector in FAMILY:
        a, b = (run.config.to_dict() for run in grid.runs
                if run.variant.name.startswith(f"{detector},"))
        a["train"].pop("output_dir"), b["train"].pop("output_dir")
        for key in ("rpe", "encodings"):
            a["model"].pop(key), b["model"].pop(key)
        assert a == b, detector
