"""Helpers shared by several test modules (plain functions; fixtures live in conftest.py).
Test modules import from here, never from each other."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import detr_irpe.cli.programs.export
from detr_irpe.config import Config, DataConfig, load_config
from detr_irpe.data.synthetic import SyntheticSpec
from detr_irpe.irpe import register_bucket_method

ROOT = Path(__file__).resolve().parent.parent
# The config every small training / model / tool test starts from (configs/synthetic_tiny.yaml).
TINY_CONFIG = "synthetic_tiny"
# generate_dataset() arguments of the session's tiny dataset (the ``tiny_dataset`` fixture).
TINY_DATASET: dict[str, Any] = {
    "num_train": 8, "num_val": 4, "spec": SyntheticSpec(size=64), "seed": 0,
}


def chessboard_buckets(dr: torch.Tensor, dc: torch.Tensor, ratio: float) -> torch.Tensor:
    """A registered bucket method for the tests (as a user would write one): the
    chessboard (Chebyshev) distance ``max(|dr|, |dc|)`` capped at ``floor(2 ratio)``."""
    return torch.maximum(dr.abs(), dc.abs()).clamp(max=math.floor(2 * ratio)).long()


# Registered once per process (registering the same function again is a no-op);
# tests/irpe_reference.py holds its python-loop reference under the same name.
CHEBYSHEV = "chessboard"
register_bucket_method(CHEBYSHEV, chessboard_buckets,
                       num_buckets=lambda ratio: math.floor(2 * ratio) + 1)


def axis_step_buckets(dr: torch.Tensor, dc: torch.Tensor, ratio: float) -> torch.Tensor:
    """A registered two-table method for the tests (a rows and a columns table, like
    ``cross``): ``min(|dr|, floor(2 ratio))`` and ``min(|dc|, floor(2 ratio))``."""
    cap = math.floor(2 * ratio)
    return torch.stack([dr.abs().clamp(max=cap), dc.abs().clamp(max=cap)]).long()


# tests/irpe_reference.py holds its python-loop reference under the same name.
AXIS_STEPS = "axis_steps"
register_bucket_method(AXIS_STEPS, axis_step_buckets, tables=2,
                       num_buckets=lambda ratio: math.floor(2 * ratio) + 1)


def load_tiny_config(*overrides: str) -> Config:
    """The tiny config with ``section.key=value`` overrides applied."""
    return load_config(TINY_CONFIG, overrides)


def config_hf_folder(name: str, path: Path, overrides: tuple[str, ...] = ()) -> Path:
    """The model of config ``name`` (3 classes, random weights, seed 0) written as a
    transformers folder at ``path`` (``--to hf``)."""
    from detr_irpe.checkpoint.hf_folder import write_hf_folder
    from detr_irpe.models import build_model

    cfg = load_config(name, ["model.num_classes=3", *overrides])
    torch.manual_seed(0)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    write_hf_folder(model.state_dict(), cfg, path)
    return path


def load_script(relative: str) -> ModuleType:
    """Import the script at ``relative`` (to the repository root) as a module without
    touching ``sys.path``."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py`` as a module without touching ``sys.path``."""
    return load_script(f"tools/{name}.py")


# ----------------------------------------------------------------------------- processes

def wait_until(condition: Callable[[], bool], proc: subprocess.Popen, what: str,
               timeout: float = 60.0) -> None:
    """Return once ``condition()`` holds (checked every 10 ms: it watches files the
    process ``proc`` writes). Fails, with the process's output, when ``proc`` ends first;
    kills ``proc`` and fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(
                f"process ended ({proc.returncode}) before {what}:\n{out or ''}{err or ''}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.01)


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Return once ``path`` exists (``proc`` creates it); see ``wait_until``."""
    wait_until(path.exists, proc, str(path), timeout)


# ----------------------------------------------------------------------------- float order

# Two float32 computations of the same quantity that differ only in the order of their
# sums (another batch split or image order, thread count, process count, memory layout)
# may differ by this fraction of the tensor's largest magnitude, elementwise. The bound is
# relative to the tensor's scale, not to each element: a rounded sum is off by a fraction
# of the magnitudes of its terms, so an element that cancels to ~0 keeps the absolute
# error of its terms. Measured on the tiny model (AMD EPYC, 1 and 2 threads, batch splits
# and permutations): at most 2.3e-6 of the scale for gradients; a wrong loss normaliser
# changes every gradient tensor by more than 0.1 of its scale.
FLOAT_ORDER_REL = 1e-4


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor,
                          rel: float = FLOAT_ORDER_REL, what: str = "") -> None:
    """``actual`` equals ``expected`` elementwise within ``rel`` times ``expected``'s
    largest magnitude (see ``FLOAT_ORDER_REL``)."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * scale,
                               msg=lambda m: f"{what}: {m} (scale {scale:.3g})")


def zeroing_gradient_recorder(steps: list[list[torch.Tensor]], keep: bool = True) -> Callable:
    """An optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
    that appends the gradients each step is given, in the optimizer's parameter order, to
    ``steps`` (when ``keep``) and then sets them to zero.

    AdamW then moves no weight (it only applies its weight decay, elementwise and alike in
    every run), so every step of two runs takes its gradients at the same weights: the
    runs stay comparable to float order at every step, where the weights of two trained
    runs part by whole Adam steps wherever a gradient is ~0 and rounds to either sign."""

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if keep:
            steps.append([p.grad.clone() for p in params])
        for p in params:
            p.grad.zero_()

    return record


# ----------------------------------------------------------------------------- rectangles

# Flat colours far apart, so a box can be recovered from the pixels independently.
BACKGROUND = (128, 128, 128)
COLOURS = {1: (255, 0, 0), 2: (0, 200, 0), 3: (0, 0, 255)}


def rectangles_image(height: int, width: int, boxes: dict[int, tuple[int, int, int, int]]) -> np.ndarray:
    """(H, W, 3) uint8: flat background with solid rectangles; ``boxes`` maps
    label -> (x1, y1, x2, y2) exclusive."""
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    for label, (x1, y1, x2, y2) in boxes.items():
        pixels[y1:y2, x1:x2] = COLOURS[label]
    return pixels


def write_rectangles_dataset(root: Path, sizes: list[tuple[int, int]]) -> DataConfig:
    """A COCO-format dataset under ``root``, one image per ``(height, width)`` of ``sizes``:
    PNG images (no compression artefacts) with solid rectangles, plus one crowd box each.
    Returns the data config that reads it (the same file for train and val)."""
    (root / "images").mkdir(parents=True)
    images, annotations = [], []
    rng = np.random.default_rng(0)
    for i, (height, width) in enumerate(sizes):
        boxes = {}
        x = 2
        for label in (1, 2, 3):
            w = int(rng.integers(8, width // 4))
            h = int(rng.integers(8, height - 4))
            y = int(rng.integers(0, height - h))
            boxes[label] = (x, y, x + w, y + h)
            x += w + int(rng.integers(2, 6))
        Image.fromarray(rectangles_image(height, width, boxes)).save(root / "images" / f"{i}.png")
        images.append({"id": i + 1, "file_name": f"{i}.png", "height": height, "width": width})
        for label, (x1, y1, x2, y2) in boxes.items():
            annotations.append({
                "id": len(annotations) + 1, "image_id": i + 1, "category_id": label,
                "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0,
            })
        annotations.append({  # crowd: never a training target
            "id": len(annotations) + 1, "image_id": i + 1, "category_id": 1,
            "bbox": [0, 0, 5, 5], "area": 25, "iscrowd": 1,
        })
    categories = [{"id": k, "name": f"c{k}", "supercategory": "x"} for k in (1, 2, 3)]
    (root / "ann.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    return DataConfig(
        root=str(root), train_ann="ann.json", train_images="images", val_ann="ann.json",
        val_images="images", augmentation="detr", train_scales=[48, 64, 80],
        crop_resize_scales=[70], crop_size=[30, 60], max_size=140, val_size=64,
    )


# ----------------------------------------------------------------------------- PNG bomb

# Side of the decompression-bomb PNG: far above any pixel limit once decoded.
BOMB_SIDE = 30000


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    body = kind + payload
    return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))


def write_png_bomb(path: Path, side: int = BOMB_SIDE) -> Path:
    """A valid 1-bit grayscale PNG of ``side x side`` black pixels: about 110 KB on disk
    for 900 million pixels (2.7 GB as RGB once decoded)."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    compressor = zlib.compressobj(9)
    rows_per_block = 1000
    data = b"".join(compressor.compress(row * rows_per_block) for _ in range(side // rows_per_block))
    data += compressor.compress(row * (side % rows_per_block)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
                     + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b""))
    return path


@torch.no_grad()
def randomise(module: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer to random values of a sensible scale (BN variances > 0),
    so that a wrong name or a swapped tensor shows in the outputs."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in module.state_dict().items():
        if not tensor.is_floating_point():
            continue
        if name.endswith("running_var") or (tensor.dim() == 1 and name.endswith("weight")):
            values = torch.rand(tensor.shape, generator=gen) + 0.5
        elif tensor.dim() == 1:
            values = torch.randn(tensor.shape, generator=gen) * 0.1
        else:  # fan-in scaled, so that activations neither vanish nor saturate
            values = torch.randn(tensor.shape, generator=gen) * tensor[0].numel() ** -0.5
        tensor.copy_(values)


def record_exported_model(monkeypatch: Any) -> dict[str, Any]:
    """Replace the export tool's ``export_onnx`` by a stand-in that writes a dummy file and
    records the state dict of the model it is given (``["state"]`` of the returned dict):
    which weights the export tool hands over, without the ONNX conversion itself. (The
    name in the tool's program is replaced: it imported the function at its top.)"""
    received: dict[str, Any] = {}

    def export_onnx(model: torch.nn.Module, path: str | Path, size: Any, **kwargs: Any) -> Path:
        received["state"] = model.state_dict()
        Path(path).write_bytes(b"onnx")
        return Path(path)

    monkeypatch.setattr(detr_irpe.cli.programs.export, "export_onnx", export_onnx)
    return received


# Tensor methods that read a value back to the host (a device synchronisation on CUDA).
READ_BACKS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_read_back(monkeypatch: pytest.MonkeyPatch):
    """Every tensor -> host read raises inside the block."""
    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host read-back Tensor.{name} inside a sync-free region")
        return method

    with monkeypatch.context() as patch:
        for name in READ_BACKS:
            patch.setattr(torch.Tensor, name, refuse(name))
        yield


# ----------------------------------------------------------------------------- other formats
# The tiny dataset's class names, in category-id order (written as YOLO / VOC names).
YOLO_NAMES = ["circle", "square", "triangle"]


def coco_boxes(root: Path, split: str) -> tuple[dict, dict[str, list]]:
    """The split's document and ``{file name: [(category id, [x, y, w, h]), ...]}``."""
    doc = json.loads((root / "annotations" / f"instances_{split}.json").read_text())
    names = {img["id"]: img["file_name"] for img in doc["images"]}
    boxes: dict[str, list] = {img["file_name"]: [] for img in doc["images"]}
    for ann in doc["annotations"]:
        boxes[names[ann["image_id"]]].append((ann["category_id"], ann["bbox"]))
    return doc, boxes


def yolo_lines(doc: dict, image: dict) -> list[str]:
    """YOLO's definition: class (0-based) and the box centre and size over the image's."""
    w, h = image["width"], image["height"]
    return [f"{a['category_id'] - 1} {(a['bbox'][0] + a['bbox'][2] / 2) / w:.6f} "
            f"{(a['bbox'][1] + a['bbox'][3] / 2) / h:.6f} {a['bbox'][2] / w:.6f} "
            f"{a['bbox'][3] / h:.6f}"
            for a in doc["annotations"] if a["image_id"] == image["id"]]


def write_yolo(coco_root: Path, out: Path, layout: str) -> Path:
    """The tiny dataset as a YOLO export: ``ultralytics`` (images/<split>, labels/<split>,
    data.yaml), ``roboflow`` (<split>/images, <split>/labels, ``valid``, data.yaml with
    ../ paths), ``labelstudio`` (images/, labels/, classes.txt: one split), ``cvat``
    (obj.names, obj_train_data/ with images and labels together: one split)."""
    for split in ("train", "val"):
        doc, _ = coco_boxes(coco_root, split)
        if layout in ("labelstudio", "cvat") and split == "val":
            continue
        images, labels = {
            "ultralytics": (out / "images" / split, out / "labels" / split),
            "roboflow": (out / {"val": "valid"}.get(split, split) / "images",
                         out / {"val": "valid"}.get(split, split) / "labels"),
            "labelstudio": (out / "images", out / "labels"),
            "cvat": (out / "obj_train_data", out / "obj_train_data"),
        }[layout]
        images.mkdir(parents=True, exist_ok=True)
        labels.mkdir(parents=True, exist_ok=True)
        for image in doc["images"]:
            shutil.copy(coco_root / split / image["file_name"], images / image["file_name"])
            lines = yolo_lines(doc, image)
            if lines:  # an image without objects has no label file, as the tools write
                (labels / f"{Path(image['file_name']).stem}.txt").write_text("\n".join(lines) + "\n")
    if layout == "ultralytics":
        (out / "data.yaml").write_text(
            "path: .\ntrain: images/train\nval: images/val\nnames:\n"
            + "".join(f"  {k}: {n}\n" for k, n in enumerate(YOLO_NAMES)))
    elif layout == "roboflow":
        (out / "data.yaml").write_text(
            f"train: ../train/images\nval: ../valid/images\nnc: 3\nnames: {YOLO_NAMES}\n")
    else:
        (out / ("classes.txt" if layout == "labelstudio" else "obj.names")).write_text(
            "\n".join(YOLO_NAMES) + "\n")
    return out


def write_voc(coco_root: Path, out: Path, layout: str) -> Path:
    """The tiny dataset as Pascal VOC: ``devkit`` (Annotations/, JPEGImages/,
    ImageSets/Main/train.txt and val.txt) or ``labelimg`` (XML next to the images, the
    training split only). Corners are 1-based inclusive: ``xmin = x + 1``, ``xmax = x + w``."""
    for split in ("train", "val"):
        if layout == "labelimg" and split == "val":
            continue
        doc, _ = coco_boxes(coco_root, split)
        images = out / ("JPEGImages" if layout == "devkit" else ".")
        xmls = out / ("Annotations" if layout == "devkit" else ".")
        images.mkdir(parents=True, exist_ok=True)
        xmls.mkdir(parents=True, exist_ok=True)
        stems = []
        for image in doc["images"]:
            stem = f"{split}_{Path(image['file_name']).stem}"
            stems.append(stem)
            shutil.copy(coco_root / split / image["file_name"], images / f"{stem}.jpg")
            objects = "".join(
                f"<object><name>{YOLO_NAMES[a['category_id'] - 1]}</name><difficult>0</difficult>"
                f"<bndbox><xmin>{a['bbox'][0] + 1}</xmin><ymin>{a['bbox'][1] + 1}</ymin>"
                f"<xmax>{a['bbox'][0] + a['bbox'][2]}</xmax><ymax>{a['bbox'][1] + a['bbox'][3]}"
                f"</ymax></bndbox></object>"
                for a in doc["annotations"] if a["image_id"] == image["id"])
            (xmls / f"{stem}.xml").write_text(
                f"<annotation><filename>{stem}.jpg</filename><size><width>{image['width']}"
                f"</width><height>{image['height']}</height><depth>3</depth></size>{objects}"
                "</annotation>")
        if layout == "devkit":
            lists = out / "ImageSets" / "Main"
            lists.mkdir(parents=True, exist_ok=True)
            (lists / f"{split}.txt").write_text("\n".join(stems) + "\n")
    return out


def two_rectangles() -> np.ndarray:
    """A 96 x 144 (h x w) uint8 picture: a red and a green rectangle on grey (the figure
    tests' image)."""
    import numpy as np  # (numpy comes with torch; imported where a test asks for it)

    image = np.full((96, 144, 3), 60, dtype=np.uint8)
    image[10:50, 20:70] = (220, 40, 40)
    image[40:90, 90:140] = (40, 200, 60)
    return image


# The slow set's largest tests write a few GB each into their tmp_path (grids of runs with
# their checkpoints, Hugging Face exports of R50 models); setup.cfg removes each passing
# test's folder when it ends (make test-all peaked at 4.1 GB). Below this much free space
# the suite may fail for want of it.
SUITE_DISK_GB = 8


def disk_header() -> str:
    """pytest's header line (tests/conftest.py): the free space where tmp_path lives."""
    where = tempfile.gettempdir()
    free = shutil.disk_usage(where).free / 2**30
    line = f"disk: {free:.1f} GB free in {where}"
    if free < SUITE_DISK_GB:
        line += (f" -- less than the {SUITE_DISK_GB} GB the slow tests may need at once;"
                 " free some space or point --basetemp at a larger disk")
    return line
