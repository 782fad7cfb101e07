#!/usr/bin/env python
"""Generate a small COCO-format detection dataset of real photo crops, offline.

    pip install ".[photos]"          # scikit-image, for its bundled sample photos
    python datasets/make_photos.py --out datasets/photos

Objects of 8 classes are cut from the sample photos that scikit-image and matplotlib ship in
their wheels (no download): a cat's face, a coffee cup, a rocket on its launch pad, a human
face (two people), a motorcycle, a gift box, a coin (eight coins), a man with a camera. Each
is pasted at a random scale (small ones included), position and mirror, with colour jitter,
onto a background cropped from other sample photos (grass, gravel, brick, the moon, a
Hubble deep field, a stained tissue section, a retina). These are composites of real photo
crops, not natural scenes: the objects look real, their surroundings do not. Each class has
only one to eight source crops, so the validation split holds the same objects in new
places, sizes and colours. The same ``--seed`` gives byte-identical files.

Layout as ``datasets/make_synthetic.py`` writes it (``annotations/instances_{train,val}.json``,
``train/``, ``val/``); ids 1-8, so the DETR-family configs have 9 outputs.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from detr_irpe.utils.files import atomic_write, atomic_write_text

PROG = "make_photos.py"

# class name -> source crops: (image, (x0, y0, x1, y1) in the photo's pixels, mask shape);
# "rect" is a rectangle with feathered edges, "ellipse" an inscribed ellipse, "alpha" the
# image's own transparency
CLASSES: dict[str, list[tuple[str, tuple[int, int, int, int], str]]] = {
    "cat": [("chelsea", (70, 0, 430, 300), "ellipse")],
    "cup": [("coffee", (40, 40, 480, 390), "ellipse")],
    "rocket": [("rocket", (270, 110, 350, 410), "rect")],
    "face": [("astronaut", (140, 20, 260, 190), "ellipse"),
             ("grace_hopper", (150, 40, 370, 390), "ellipse")],
    "motorcycle": [("motorcycle", (30, 140, 735, 480), "rect")],
    "gift": [("gift", (0, 0, 128, 128), "alpha")],
    "coin": [("coins", (c0 - 2, r0 - 2, c1 + 2, r1 + 2), "ellipse") for r0, c0, r1, c1 in (
        (96, 245, 144, 296), (104, 25, 146, 67), (105, 185, 144, 227), (156, 315, 218, 380),
        (170, 189, 216, 237), (233, 18, 288, 75), (236, 144, 288, 201), (240, 276, 288, 326))],
    "cameraman": [("camera", (90, 40, 340, 460), "rect")],
}
BACKGROUNDS = ("grass", "gravel", "brick", "moon", "hubble_deep_field",
               "immunohistochemistry", "retina")
SPLIT_IDS = {"train": 0, "val": 1}


class PhotosUnavailable(RuntimeError):
    pass


def _load_photos() -> dict[str, np.ndarray]:
    """Every photo used, as float32 RGB (or RGBA for the gift) in 0..255; from the wheels."""
    try:
        import skimage.data as skdata
    except ImportError as exc:
        raise PhotosUnavailable(
            "needs scikit-image for its bundled photos: pip install '.[photos]'") from exc
    from matplotlib import cbook

    photos: dict[str, np.ndarray] = {}
    for name in ("chelsea", "coffee", "rocket", "astronaut", "coins", "camera", "grass",
                 "gravel", "brick", "moon", "hubble_deep_field", "immunohistochemistry",
                 "retina"):
        photos[name] = np.asarray(getattr(skdata, name)())
    photos["motorcycle"] = np.asarray(skdata.stereo_motorcycle()[0])
    for name, file in (("grace_hopper", "grace_hopper.jpg"),
                       ("gift", "Minduka_Present_Blue_Pack.png")):
        with cbook.get_sample_data(file) as f, Image.open(f) as im:
            photos[name] = np.asarray(im.convert("RGBA" if name == "gift" else "RGB"))
    out = {}
    for name, a in photos.items():
        a = a.astype(np.float32)
        if a.ndim == 2:
            a = np.repeat(a[:, :, None], 3, axis=2)
        out[name] = a
    return out


def _mask(kind: str, h: int, w: int, alpha: np.ndarray | None) -> np.ndarray:
    if kind == "alpha":
        assert alpha is not None
        return alpha / 255.0
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == "ellipse":
        r = np.sqrt(((xx + 0.5) / w * 2 - 1) ** 2 + ((yy + 0.5) / h * 2 - 1) ** 2)
        return np.clip((1.0 - r) * min(h, w) / 3.0, 0.0, 1.0)
    edge = np.minimum(np.minimum(xx + 0.5, w - xx - 0.5), np.minimum(yy + 0.5, h - yy - 0.5))
    return np.clip(edge / 1.5, 0.0, 1.0)


def _resize(a: np.ndarray, w: int, h: int) -> np.ndarray:
    chans = [np.asarray(Image.fromarray(a[:, :, c]).resize((w, h), Image.BILINEAR,
                                                           reducing_gap=2.0))
             for c in range(a.shape[2])]
    return np.stack(chans, axis=2)


def _jitter(rng: np.random.Generator, rgb: np.ndarray, strength: float) -> np.ndarray:
    """Brightness, contrast, saturation and per-channel gain, in 0..255."""
    mean = rgb.mean()
    rgb = (rgb - mean) * rng.uniform(1 - 0.4 * strength, 1 + 0.4 * strength) + mean
    rgb = rgb * rng.uniform(1 - 0.35 * strength, 1 + 0.35 * strength)
    grey = rgb.mean(axis=2, keepdims=True)
    rgb = grey + (rgb - grey) * rng.uniform(1 - 0.6 * strength, 1 + 0.6 * strength)
    rgb = rgb * rng.uniform(1 - 0.15 * strength, 1 + 0.15 * strength, size=3)
    return np.clip(rgb, 0, 255)


def _background(rng: np.random.Generator, photos: dict[str, np.ndarray], size: int) -> np.ndarray:
    src = photos[BACKGROUNDS[rng.integers(len(BACKGROUNDS))]]
    h, w = src.shape[:2]
    side = int(rng.uniform(0.3, 0.9) * min(h, w))
    y0, x0 = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
    crop = _resize(src[y0:y0 + side, x0:x0 + side], size, size)
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    if np.ptp(crop.reshape(-1, 3).mean(axis=0)) < 1.0:     # a grey photo: tint it
        crop = crop * rng.uniform(0.6, 1.2, size=3)
    return _jitter(rng, crop, 1.0)


def render(rng: np.random.Generator, photos: dict[str, np.ndarray], size: int,
           max_objects: int, object_size: tuple[float, float]) -> tuple[np.ndarray, list[dict]]:
    canvas = _background(rng, photos, size)
    owner = np.full((size, size), -1, dtype=np.int32)
    names = list(CLASSES)
    objects: list[dict] = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        cls = int(rng.integers(len(names)))
        sources = CLASSES[names[cls]]
        photo, (x0, y0, x1, y1), kind = sources[rng.integers(len(sources))]
        src = photos[photo][y0:y1, x0:x1]
        # the longer side, log-uniform in object_size x image side (small objects as often
        # as large ones), the aspect ratio jittered by up to 15 %
        longer = size * float(np.exp(rng.uniform(*np.log(object_size))))
        aspect = (x1 - x0) / (y1 - y0) * rng.uniform(0.85, 1.15)
        w = max(4, round(longer if aspect >= 1 else longer * aspect))
        h = max(4, round(longer / aspect if aspect >= 1 else longer))
        w, h = min(w, size), min(h, size)
        patch = _resize(src, w, h)
        if rng.random() < 0.5:
            patch = patch[:, ::-1]
        alpha = _mask(kind, h, w, patch[:, :, 3] if kind == "alpha" else None)
        rgb = _jitter(rng, patch[:, :, :3], 1.0)
        for _try in range(20):
            px, py = int(rng.integers(0, size - w + 1)), int(rng.integers(0, size - h + 1))
            covered = owner[py:py + h, px:px + w][alpha > 0.5]
            # an earlier object may lose at most 30 % of what is visible of it
            if all((covered == i).sum() <= 0.3 * (owner == i).sum() for i in range(len(objects))):
                break
        else:
            continue
        region = canvas[py:py + h, px:px + w]
        region[:] = region * (1 - alpha[:, :, None]) + rgb * alpha[:, :, None]
        owner[py:py + h, px:px + w][alpha > 0.5] = len(objects)
        objects.append({"category_id": cls + 1})
    canvas = canvas + rng.normal(0, rng.uniform(0, 4), canvas.shape)
    kept = []
    for i, obj in enumerate(objects):
        ys, xs = np.nonzero(owner == i)
        if len(xs) == 0:
            continue
        bx, by = int(xs.min()), int(ys.min())
        bw, bh = int(xs.max()) + 1 - bx, int(ys.max()) + 1 - by
        kept.append({**obj, "bbox": [bx, by, bw, bh], "area": int(len(xs))})
    return np.clip(np.round(canvas), 0, 255).astype(np.uint8), kept


def write_split(out: Path, split: str, num_images: int, args: argparse.Namespace,
                photos: dict[str, np.ndarray]) -> int:
    (out / split).mkdir(parents=True, exist_ok=True)
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for index in range(num_images):
        rng = np.random.default_rng(np.random.SeedSequence([args.seed, SPLIT_IDS[split], index]))
        pixels, objects = render(rng, photos, args.size, args.max_objects,
                                 tuple(args.object_size))
        file_name = f"{index:06d}.jpg"
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, format="JPEG", quality=args.jpeg_quality)
        data = encoded.getvalue()
        atomic_write(out / split / file_name, lambda f, data=data: f.write(data), durable=False)
        images.append({"id": index + 1, "file_name": file_name,
                       "height": args.size, "width": args.size})
        for obj in objects:
            annotations.append({"id": len(annotations) + 1, "image_id": index + 1,
                                "category_id": obj["category_id"], "bbox": obj["bbox"],
                                "area": obj["area"], "iscrowd": 0})
    document = {
        "info": {"description": f"detr_irpe photo composites ({split}): real photo crops "
                                "from scikit-image and matplotlib sample data pasted onto "
                                "crops of other photos, not natural scenes",
                 "contributor": "datasets/make_photos.py", "seed": args.seed,
                 "size": args.size, "max_objects": args.max_objects,
                 "object_size": list(args.object_size)},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": n} for i, n in enumerate(CLASSES)],
    }
    atomic_write_text(out / "annotations" / f"instances_{split}.json",
                      json.dumps(document, separators=(",", ":")))
    return len(annotations)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num-train", type=int, default=800)
    p.add_argument("--num-val", type=int, default=200)
    p.add_argument("--size", type=int, default=128, help="image side in pixels (square)")
    p.add_argument("--max-objects", type=int, default=3, help="1..N objects per image")
    p.add_argument("--object-size", type=float, nargs=2, default=[0.12, 0.6],
                   metavar=("MIN", "MAX"),
                   help="an object's longer side as a fraction of the image side, "
                        "log-uniform between MIN and MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jpeg-quality", type=int, default=90)
    args = p.parse_args(argv)
    if args.num_train < 0 or args.num_val < 0:
        p.error("--num-train and --num-val must be >= 0")
    if not 16 <= args.size <= 4096:
        p.error(f"--size must be in 16..4096, got {args.size}")
    if args.max_objects < 1:
        p.error(f"--max-objects must be >= 1, got {args.max_objects}")
    lo, hi = args.object_size
    if not 0 < lo <= hi <= 1:
        p.error(f"--object-size needs 0 < MIN <= MAX <= 1, got {lo} {hi}")
    if not 1 <= args.jpeg_quality <= 100:
        p.error(f"--jpeg-quality must be in 1..100, got {args.jpeg_quality}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"{PROG}: error: --out {out}: exists and is not a folder", file=sys.stderr)
        return 2
    try:
        photos = _load_photos()
    except PhotosUnavailable as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    counts = {split: write_split(out, split, n, args, photos)
              for split, n in (("train", args.num_train), ("val", args.num_val))}
    print(f"wrote {args.num_train} train images ({counts['train']} objects) and "
          f"{args.num_val} val images ({counts['val']} objects) to {out}")
    print(f"config overrides: data.root={out} data.train_ann=annotations/instances_train.json "
          "data.train_images=train data.val_ann=annotations/instances_val.json "
          "data.val_images=val")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
