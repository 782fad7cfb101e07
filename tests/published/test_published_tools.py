"""The tools on one published model per distinct architecture (``REPRESENTATIVES``) at its
published size, each reading the published file by its zoo name from the cache (DAB-DETR
/ DN-DETR by path): ``predict`` with every runtime gives the same detections,
``export --dynamic --check`` at the published size, one training step with EMA from
``--finetune NAME`` (the average of every tensor, the tied ones included, in closed form;
the first step's learning rate), ``eval --sizes`` with a larger and a non-square size on
the trained checkpoint, and a list of two images of different sizes into the model.
Which check runs on which model, and what each costs: docs/testing.md."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tool, write_rectangles_dataset
from PIL import Image
from published_models import CASES, SQUARE_FAMILIES, unmatched_detections

from detr_irpe.engine.ema import ema_decay
from detr_irpe.inference.runtime import RUNTIMES, compiler_problem

pytestmark = pytest.mark.slow

# What each check runs on (docs/testing.md, "The published-size tier": the costs).
PREDICT = ["rtdetr_r18", "deimv2_s"]
COMPILED = ["rtdetr_r18", "deimv2_s"]
EXPORT = ["dfine_s", "deimv2_s"]
TRAIN = ["dn_detr_r50", "dfine_s", "deim_s", "deimv2_s"]
LISTS = ["rtdetr_r18", "dfine_n", "deimv2_s"]

# the 480 x 640 picture of the module's dataset (train and val)
HEIGHT, WIDTH = 480, 640


def _name(published) -> str:
    """What the tools are given: the zoo name, or the path of a file without one."""
    return published.case.zoo if published.case.zoo is not None else str(published.path)


def _sizes(published) -> list[str]:
    """The published test size, a larger one and a non-square one."""
    if published.case.family in SQUARE_FAMILIES:
        side = published.cfg.data.eval_size
        return [str(side), str(side + 160), f"{side}x{side + 320}"]
    side = published.cfg.data.val_size
    return [str(side), str(side + 224), f"{side}x{side + 400}"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One 480 x 640 picture with three rectangles (categories 1-3) as the train and the
    val split: one training step of batch 1 per epoch."""
    root = tmp_path_factory.mktemp("published_data")
    write_rectangles_dataset(root, [(HEIGHT, WIDTH)])
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _data(root: Path) -> list[str]:
    return [f"data.root={root}", "data.train_ann=ann.json", "data.train_images=images",
            "data.val_ann=ann.json", "data.val_images=images", "data.num_workers=0"]


@pytest.fixture(scope="module")
def photo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with one 480 x 640 picture of seeded uniform noise: no two tokens alike
    (flat regions give tokens of exactly equal scores, whose order no runtime fixes)."""
    folder = tmp_path_factory.mktemp("published_photo")
    pixels = np.random.default_rng(0).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "noise.png")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The onnxruntime runtime's cache (``DETR_IRPE_CACHE``) for the module."""
    root = tmp_path_factory.mktemp("onnx_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DETR_IRPE_CACHE", str(root))
        yield root
    shutil.rmtree(root, ignore_errors=True)


def _predict(published, images: Path, out: Path, runtime: str) -> list[dict]:
    status = load_tool("predict").main([
        _name(published), str(images), "--output-dir", str(out), "--score-threshold", "0",
        "--no-draw", "--no-progress", "--runtime", runtime])
    assert status == 0, runtime
    return json.loads((out / "detections.json").read_text())["detections"]


def _compare(published, found: dict[str, list[dict]], reference: str = "pytorch") -> None:
    """Every runtime's detections are the reference's, as sets: the runtimes promise
    their raw outputs to 1e-3 (the onnxruntime check's bound), so scores within 1e-3 and
    boxes within 1e-3 of the picture's longer side (in pixels).

    RT-DETR and D-FINE decode the 300 tokens of highest encoder score; rounding may swap
    a token within the runtimes' differences of the 300th (2 of 8400 lie within 1e-4 of
    it with these weights: published_models.GAIN), and the swapped query's detections
    with it: up to 2 % of their detections may differ. A broken runtime changes most."""
    expected = found[reference]
    assert expected
    allowed = 0.02 if published.case.family in SQUARE_FAMILIES else 0.0
    for runtime, detections in found.items():
        assert len(detections) == len(expected), runtime
        unmatched = unmatched_detections(detections, expected, score_tol=1e-3,
                                         box_tol=1e-3 * max(HEIGHT, WIDTH))
        assert len(unmatched) <= allowed * len(expected), (
            f"{runtime} against {reference}: {len(unmatched)} of {len(expected)} detections "
            f"unmatched, first {unmatched[:2]}")


@pytest.mark.parametrize("published", PREDICT, indirect=True)
def test_predict_with_every_runtime_gives_the_same_detections(published, photo: Path,
                                                              onnx_cache: Path,
                                                              tmp_path: Path) -> None:
    """``predict NAME`` with ``pytorch``, ``fused`` and ``onnxruntime``: the same
    detections (as sets: near-tied random scores may swap places)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    runtimes = [r for r in RUNTIMES if r != "compiled"]
    found = {r: _predict(published, photo, tmp_path / r, r) for r in runtimes}
    _compare(published, found)


@pytest.mark.parametrize("published", COMPILED, indirect=True)
def test_predict_with_the_compiled_runtime(published, photo: Path, onnx_cache: Path,
                                           tmp_path: Path) -> None:
    """``--runtime compiled`` where a compiler exists: the detections of ``pytorch``
    (Inductor's cache under the module's ``DETR_IRPE_CACHE``)."""
    problem = compiler_problem()
    if problem is not None:
        pytest.skip(f"no compiler ({problem}): the compiled runtime runs the fused form")
    found = {r: _predict(published, photo, tmp_path / r, r) for r in ("pytorch", "compiled")}
    _compare(published, found)


@pytest.mark.parametrize("published", EXPORT, indirect=True)
def test_export_dynamic_check_at_the_published_size(published, tmp_path: Path) -> None:
    """``export NAME --dynamic --check --size HxW`` at the published input size: the file
    runs in onnxruntime and equals PyTorch on random images."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    if published.case.family in SQUARE_FAMILIES:
        size = f"{published.cfg.data.eval_size}x{published.cfg.data.eval_size}"
    else:
        size = f"{published.cfg.data.val_size}x{published.cfg.data.max_size}"
    out = tmp_path / "model.onnx"
    status = load_tool("export").main([_name(published), "--format", "onnx", "--size", size,
                                       "--output", str(out), "--dynamic", "--check"])
    assert status == 0 and out.stat().st_size > 0


# ----------------------------------------------------------------------------- training

def first_step_factor(cfg) -> float:
    """The share of each group's base lr that the first optimizer step runs at: the
    linear warm-up's ``1 / warmup_iters`` (none: 1), DEIM's FlatCosine ``1 / 500`` (its
    published solver's linear warm-up, built before FlatCosine: docs/training.md)."""
    if cfg.train.lr_schedule == "flatcosine":
        return 1 / 500
    return 1 / cfg.train.warmup_iters if cfg.train.warmup_iters else 1.0


@pytest.fixture(scope="module")
def trained(published, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``train --config C --finetune NAME`` for one step (one picture, batch 1), EMA on;
    its run folder."""
    out = tmp_path_factory.mktemp(f"train_{published.case.config}")
    # DEIM's FlatCosine needs epochs for its flat part and its tail: none in a 1-epoch run
    schedule = (["train.lr_flat_epochs=0", "train.lr_no_aug_epochs=0"]
                if published.cfg.train.lr_schedule == "flatcosine" else [])
    status = load_tool("train").main([
        "--config", published.case.config, "--finetune", _name(published), "--no-progress",
        "--set", *_data(dataset), "train.epochs=1", "train.batch_size=1",
        "train.ema.enabled=true", f"train.output_dir={out}", "train.loggers=[]",
        "train.amp=none", "train.num_threads=1", *schedule])
    assert status == 0
    return out


@pytest.mark.parametrize("published", TRAIN, indirect=True)
def test_one_training_step_averages_every_tensor_once(published, trained: Path) -> None:
    """After one step the EMA of every floating-point tensor loaded from the file is the
    closed form ``d_1 v_0 + (1 - d_1) w_1`` (``v_0`` the file's value, ``w_1`` the trained
    one), each tied tensor (D-FINE's ``up`` / ``reg_scale``, DAB-DETR's shared box head)
    averaged exactly once; and the step ran at the schedule's first lr."""
    saved = torch.load(trained / "checkpoint_last.pth", map_location="cpu", weights_only=True)
    ema, updates = saved["ema"]["module"], saved["ema"]["updates"]
    assert updates == 1
    cfg = published.cfg
    d = ema_decay(1, cfg.train.ema.decay, cfg.train.ema.warmup)
    start = published.model.state_dict()  # the file's weights, as loaded
    trained_w = saved["model"]
    keys = [k for k in trained_w if k in start and trained_w[k].is_floating_point()
            and start[k].shape == trained_w[k].shape]
    tied = {k for k, v in _tied_groups(published.model).items() for k in v}
    assert tied <= set(keys) or not tied
    eps = torch.finfo(torch.float32).eps
    wrong = []
    for key in keys:
        v0, w1 = start[key].double(), trained_w[key].double()
        expected = d * v0 + (1 - d) * w1
        bound = 4 * eps * (v0.abs() + w1.abs()) + 1e-30
        if not bool(((ema[key].double() - expected).abs() <= bound).all()):
            wrong.append(key)
    assert wrong == [], f"EMA not d*v0 + (1-d)*w1 for {len(wrong)} tensors, tied: " \
                        f"{sorted(set(wrong) & tied)[:4]}, first: {wrong[:4]}"
    # Adam's first step moves each weight by lr * sign(gradient) (+ its decay): the
    # largest move is the largest group's first lr, within float32's spacing
    names = {n for n, _ in published.model.named_parameters()}
    groups = cfg.train.param_groups  # set, they replace lr_backbone
    lrs = [float(g.get("lr", cfg.train.lr)) for g in groups] + [cfg.train.lr] + (
        [] if groups else [cfg.train.lr_backbone])
    top = max(lrs) * first_step_factor(cfg)
    moves = []
    for key in keys:
        if key not in names:
            continue
        w0, w1 = start[key], trained_w[key]
        spacing = torch.nextafter(w0.abs(), torch.tensor(math.inf)) - w0.abs()
        over = (w1 - w0).abs() - top * (1 + cfg.train.weight_decay * w0.abs()) - spacing
        assert float(over.max()) <= 0, f"{key} moved by more than the first lr {top:.3g}"
        small = spacing < top / 100
        if bool(small.any()):
            moves.append(float((w1 - w0).abs()[small].max()))
    assert max(moves) >= 0.5 * top, f"no weight moved by the first lr {top:.3g}: {max(moves)}"


def _tied_groups(model: torch.nn.Module) -> dict[int, list[str]]:
    """State-dict keys that name the same tensor, grouped (more than one name each)."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(key)
    return {k: v for k, v in groups.items() if len(v) > 1}


@pytest.mark.parametrize("published", TRAIN, indirect=True)
def test_eval_at_a_larger_and_a_non_square_size(published, trained: Path, dataset: Path,
                                                tmp_path: Path) -> None:
    """``eval --sizes`` on the trained checkpoint: the published test size, a larger and
    a non-square one, each evaluated (12 COCO numbers) and tabled."""
    sizes = _sizes(published)
    out = tmp_path / "eval"
    status = load_tool("eval").main([str(trained / "checkpoint_last.pth"), "--no-progress",
                                     "--output-dir", str(out), "--sizes", *sizes,
                                     "--set", *_data(dataset)])
    assert status == 0
    table = json.loads((out / "sizes.json").read_text())["sizes"]
    assert [row["size"] for row in table] == sizes
    for size in sizes:
        metrics = json.loads((out / f"size_{size}" / "metrics.json").read_text())
        assert len(metrics["bbox"]["stats"]) == 12


# ----------------------------------------------------------------------------- the model

@pytest.mark.parametrize("published", LISTS, indirect=True)
def test_a_list_of_two_sizes_gives_each_image_its_outputs(published) -> None:
    """A list of a 640 x 640 and a 480 x 640 image (docs/model.md, "Using it": a list
    is accepted): the first, already at the common size, gets its single-image outputs."""
    gen = torch.Generator().manual_seed(0)
    big, small = torch.randn(3, 640, 640, generator=gen), torch.randn(3, 480, 640, generator=gen)
    model = published.model
    with torch.no_grad():
        both = model([big, small])
        alone = model(big[None])
    for key in ("pred_logits", "pred_boxes"):
        assert both[key].shape[0] == 2
        scale = float(alone[key].abs().max())
        torch.testing.assert_close(both[key][:1], alone[key], rtol=0, atol=1e-4 * scale)
    assert CASES[published.case.config].family in SQUARE_FAMILIES
