"""Run the published DEIMv2 HGNetv2 detectors (Atto, Femto, Pico, N) on the CPU and save what
tests/models/deimv2/test_deimv2_hgnet.py compares against (``deimv2_hgnet_official_{size}.pt``
and ``deimv2_hgnet_official_keys.json`` in this folder). Not a test, and not run by one: it
needs a checkout of the published code (github.com/Intellindust-AI-Lab/DEIMv2) outside this
repository and the packages its ``engine`` imports (as make_deimv2_official.py).

    for size in atto femto pico n; do
      python tests/reference_data/deimv2/make_deimv2_hgnet_official.py --code /tmp/DEIMv2 \\
          --size $size --commit 0fff8d4 --out tests/reference_data/deimv2/deimv2_hgnet_official_$size.pt
      python tests/reference_data/deimv2/make_deimv2_hgnet_official.py --code /tmp/DEIMv2 \\
          --size $size --keys --commit 0fff8d4 \\
          --out tests/reference_data/deimv2/deimv2_hgnet_official_keys.json
    done

One model per process (the published config system keeps state between builds): the
detector of ``configs/deimv2/deimv2_hgnetv2_{size}_coco.yml`` with 5 classes, 30 queries
and 20 denoising queries, its anchors computed for the published eval size (Atto 320,
Femto 416, Pico and N 640), no pretrained backbone. The weights are
``deimv2_hgnet_weights.hgnet_state_dict`` of the built model (a function of each key),
loaded strictly after ``.double()``. The record holds, in float64, the eval outputs of two
seeded images (RGB in [0, 1], as the published transforms give them to these models) at
the eval size, and the published post-processor's detections; with ``--train`` also a
training forward with seeded denoising (its outputs but the distributions' logits).
Every float32 ``log`` is the correctly rounded one, as the tests compute it.
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "models" / "deimv2"))
from deimv2_hgnet_weights import hgnet_state_dict  # noqa: E402
from make_deimv2_official import (  # noqa: E402
    BATCH,
    NUM_CLASSES,
    NUM_DENOISING,
    NUM_QUERIES,
    TOP,
    TRAIN_SEED,
    _flat,
    correctly_rounded_log,
    images,
    targets,
)

CONFIG = "configs/deimv2/deimv2_hgnetv2_{}_coco.yml"
EVAL_SIZES = {"atto": 320, "femto": 416, "pico": 640, "n": 640}


def _engine(code: str):
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)
    from engine.core import YAMLConfig

    return YAMLConfig


def _published_model(code: str, size: str, side: int):
    config = _engine(code)(CONFIG.format(size), HGNetv2={"pretrained": False},
                           num_classes=NUM_CLASSES, eval_spatial_size=[side, side],
                           DEIMTransformer={"num_queries": NUM_QUERIES,
                                            "num_denoising": NUM_DENOISING},
                           PostProcessor={"num_top_queries": TOP})
    model = config.model.double()
    model.load_state_dict(hgnet_state_dict(model), strict=True)
    return model.eval(), config.postprocessor


def _write_keys(code: str, size: str, commit: str, out_path: Path) -> None:
    model = _engine(code)(CONFIG.format(size), HGNetv2={"pretrained": False}).model
    merged = json.loads(out_path.read_text()) if out_path.exists() else {}
    merged[size] = {"config": CONFIG.format(size),
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "keys": [[k, list(v.shape)] for k, v in model.state_dict().items()]}
    merged["commit"] = commit or merged.get("commit", "")
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(merged.items()))) + "\n")
    tmp.replace(out_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", required=True, help="the published repository's folder")
    parser.add_argument("--size", choices=sorted(EVAL_SIZES), required=True)
    parser.add_argument("--train", action="store_true",
                        help="also a training forward with seeded denoising")
    parser.add_argument("--keys", action="store_true",
                        help="instead: the published detector's (80 classes) state-dict keys, "
                             "shapes and parameter count, merged into --out (JSON)")
    parser.add_argument("--commit", default="", help="the published code's commit (recorded)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_path = Path(args.out).resolve()
    if args.keys:
        _write_keys(args.code, args.size, args.commit, out_path)
        return
    side = EVAL_SIZES[args.size]
    with correctly_rounded_log():
        model, postprocessor = _published_model(args.code, args.size, side)
    x = images(side, side)
    with torch.no_grad(), correctly_rounded_log():
        out = model(x)
    sizes_wh = torch.tensor([[640, 480], [333, 500]])
    results = postprocessor(out, sizes_wh)
    record = {
        "commit": args.commit, "config": CONFIG.format(args.size), "size": args.size,
        "image_shape": [BATCH, 3, side, side], "num_classes": NUM_CLASSES,
        "num_queries": NUM_QUERIES, "num_denoising": NUM_DENOISING,
        "eval": {"pred_logits": out["pred_logits"], "pred_boxes": out["pred_boxes"]},
        "post": {"orig_target_sizes_wh": sizes_wh, "num_top_queries": TOP,
                 "results": [{k: v.clone() for k, v in r.items()} for r in results]},
    }
    if args.train:
        model.train()
        torch.manual_seed(TRAIN_SEED)
        with correctly_rounded_log():
            train_out = model(x, targets())
        meta = train_out["dn_meta"]
        record["train"] = {"seed": TRAIN_SEED, "outputs": _flat(train_out),
                           "dn_num_group": meta["dn_num_group"],
                           "dn_num_split": list(meta["dn_num_split"]),
                           "dn_positive_idx": [t.clone() for t in meta["dn_positive_idx"]]}
    tmp = out_path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(out_path)


if __name__ == "__main__":
    main()
