"""Run the published D-FINE / DEIM code on the CPU and save what the tests compare against
(``dfine_official_*.pt``, ``dfine_official_keys.json``). Not a test, and not run by one:
it needs a checkout of the published code (github.com/Peterande/D-FINE, or
github.com/ShihuaHuang95/DEIM) outside this repository, and ``scipy``,
``faster_coco_eval`` and ``tensorboard``, which the published packages import.

    python tests/reference_data/make_dfine_official.py --code /tmp/D-FINE --kind dfine \\
        --size n --mode outputs --out /tmp/dfine_official_n.pt
    python tests/reference_data/make_dfine_official.py --code /tmp/D-FINE --kind dfine \\
        --size l --mode keys --out /tmp/keys_dfine_l.json

One model per process (the published config system keeps state between builds). The
weights are :func:`dfine_weights.synthetic_state_dict` of the built model (a function of
each key), loaded strictly; ``outputs`` saves, in float64, the eval outputs of two seeded
images and the published post-processor's detections (with ``--train`` also a training
forward with seeded denoising); ``keys`` the state-dict keys and shapes of the published
model (80 classes) and its parameter count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "models" / "dfine"))
from dfine_weights import synthetic_state_dict  # noqa: E402

CONFIGS = {"dfine": "configs/dfine/dfine_hgnetv2_{}_coco.yml",
           "deim": "configs/deim_dfine/deim_hgnetv2_{}_coco.yml"}
# the small-output settings: 5 classes, 30 queries, 20 denoising queries, 128 x 192 images
NUM_CLASSES, NUM_QUERIES, NUM_DENOISING, TOP = 5, 30, 20, 50
IMAGE = (2, 3, 128, 192)
TRAIN_SEED = 7


def images() -> torch.Tensor:
    """The seeded input (RGB in [0, 1])."""
    return torch.rand(*IMAGE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def targets() -> list[dict]:
    return [{"labels": torch.tensor([1, 4, 0]),
             "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.3], [0.25, 0.3, 0.2, 0.25],
                                    [0.7, 0.6, 0.1, 0.3]], dtype=torch.float64)},
            {"labels": torch.tensor([2]),
             "boxes": torch.tensor([[0.4, 0.55, 0.5, 0.6]], dtype=torch.float64)}]


def _import_published(code: str, kind: str):
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)
    if kind == "dfine":
        from src.core import YAMLConfig
    else:
        from engine.core import YAMLConfig
    return YAMLConfig


def _flat(out: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in out.items():
        if torch.is_tensor(value):
            # detached, not copied: the teachers (the last layer's tensors) are stored once
            flat[prefix + key] = value.detach()
        elif isinstance(value, dict) and key != "dn_meta":
            flat.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, d in enumerate(value):
                flat.update(_flat(d, f"{prefix}{key}.{i}."))
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", required=True, help="the published repository's folder")
    parser.add_argument("--kind", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--size", choices=list("nsmlx"), required=True)
    parser.add_argument("--mode", choices=("keys", "outputs"), required=True)
    parser.add_argument("--train", action="store_true",
                        help="also a training forward with seeded denoising")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_path = Path(args.out).resolve()
    yaml_config = _import_published(args.code, args.kind)
    path = CONFIGS[args.kind].format(args.size)
    post = "DFINEPostProcessor" if args.kind == "dfine" else "PostProcessor"
    if args.mode == "keys":
        cfg = yaml_config(path, HGNetv2={"pretrained": False})
        model = cfg.model
        state = model.state_dict()
        record = {"config": path, "parameters": sum(p.numel() for p in model.parameters()),
                  "keys": [[k, list(v.shape)] for k, v in state.items()]}
        out_path.write_text(json.dumps(record))
        return
    cfg = yaml_config(path, HGNetv2={"pretrained": False}, num_classes=NUM_CLASSES,
                      eval_spatial_size=list(IMAGE[2:]),
                      DFINETransformer={"num_queries": NUM_QUERIES,
                                        "num_denoising": NUM_DENOISING},
                      **{post: {"num_top_queries": TOP}})
    model, postprocessor = cfg.model, cfg.postprocessor
    model.load_state_dict(synthetic_state_dict(model.state_dict()), strict=True)
    model = model.double().eval()
    x = images()
    with torch.no_grad():
        out = model(x)
    sizes_wh = torch.tensor([[640, 480], [333, 500]])
    results = postprocessor(out, sizes_wh)
    record = {
        "config": path, "image_shape": list(IMAGE), "num_classes": NUM_CLASSES,
        "num_queries": NUM_QUERIES, "num_denoising": NUM_DENOISING,
        "eval": {"pred_logits": out["pred_logits"], "pred_boxes": out["pred_boxes"]},
        "post": {"orig_target_sizes_wh": sizes_wh, "num_top_queries": TOP,
                 "results": [{k: v.clone() for k, v in r.items()} for r in results]},
    }
    if args.train:
        model.train()
        torch.manual_seed(TRAIN_SEED)
        train_out = model(x, targets())
        meta = train_out["dn_meta"]
        record["train"] = {"seed": TRAIN_SEED, "outputs": _flat(train_out),
                           "dn_num_group": meta["dn_num_group"],
                           "dn_num_split": list(meta["dn_num_split"]),
                           "dn_positive_idx": [t.clone() for t in meta["dn_positive_idx"]]}
    torch.save(record, out_path)


if __name__ == "__main__":
    main()
