"""Run the published DEIMv2 detectors on the CPU and save what the tests compare against
(``deimv2_official_{s,l}.pt``, ``deimv2_official_{s,l}_640.pt`` in this folder). Not a test,
and not run by one: it needs a checkout of the published code
(github.com/Intellindust-AI-Lab/DEIMv2) outside this repository, and the packages its
``engine`` imports (``scipy``, ``faster_coco_eval``, ``tensorboard``; ``calflops`` is
replaced by a dummy).

    python tests/reference_data/deimv2/make_deimv2_official.py --code /tmp/DEIMv2 \\
        --size s --train --commit 0fff8d4 --out tests/reference_data/deimv2/deimv2_official_s.pt
    python tests/reference_data/deimv2/make_deimv2_official.py --code /tmp/DEIMv2 \\
        --size s --image 640 640 --commit 0fff8d4 \\
        --out tests/reference_data/deimv2/deimv2_official_s_640.pt
    python tests/reference_data/deimv2/make_deimv2_official.py --code /tmp/DEIMv2 \\
        --size m --keys --commit 0fff8d4 \\
        --out tests/reference_data/deimv2/deimv2_official_model_keys.json

One model per process (the published config system keeps state between builds): the
detector of ``configs/deimv2/deimv2_dinov3_{size}_coco.yml`` with 5 classes, 30 queries and
20 denoising queries, its anchors computed for the image size. The weights are
``deimv2_weights.deimv2_state_dict`` of the built model (a function of each key; the RoPE
periods and DINOv3's key-bias mask as published), loaded strictly after ``.double()``;
the RoPE tables are computed in float64 (``rope_embed.dtype``; published: float32). The
record holds, in float64, the eval outputs of seeded images (RGB in [0, 1], handed to the
network as they are: the published transforms would have normalised them) and the
published post-processor's detections; with ``--train`` also a training forward with
seeded denoising (its outputs but the distributions' logits). Every float32 ``log`` is
the correctly rounded one (:func:`correctly_rounded_log`), as the tests compute it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "models" / "deimv2"))
from deimv2_weights import deimv2_state_dict  # noqa: E402

F64 = torch.float64
CONFIG = "configs/deimv2/deimv2_dinov3_{}_coco.yml"
NUM_CLASSES, NUM_QUERIES, NUM_DENOISING, TOP = 5, 30, 20, 50
BATCH = 2
TRAIN_SEED = 7


def images(height: int, width: int) -> torch.Tensor:
    """The seeded input (values in [0, 1])."""
    return torch.rand(BATCH, 3, height, width, generator=torch.Generator().manual_seed(0),
                      dtype=F64)


def targets() -> list[dict]:
    return [{"labels": torch.tensor([1, 4, 0]),
             "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.3], [0.25, 0.3, 0.2, 0.25],
                                    [0.7, 0.6, 0.1, 0.3]], dtype=F64)},
            {"labels": torch.tensor([2]),
             "boxes": torch.tensor([[0.4, 0.55, 0.5, 0.6]], dtype=F64)}]


@contextmanager
def correctly_rounded_log():
    """Every float32 ``torch.log`` (the anchors', the denoising boxes' inverse sigmoid) is
    the float64 one rounded once, so that the data do not depend on this CPU's float32
    ``log`` (tests/official_numerics.py, ``reference_float32("dfine")``)."""
    log = torch.log

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return log(x.double()).float() if x.dtype == torch.float32 else log(x)

    with mock.patch.object(torch, "log", rounded):
        yield


def _flat(out: dict, prefix: str = "") -> dict:
    """The tensors of a training output, by dotted key; the distributions' logits
    (``*corners``) left out, to keep the file small."""
    flat = {}
    for key, value in out.items():
        if torch.is_tensor(value):
            if not key.endswith("corners"):
                flat[prefix + key] = value.detach()
        elif isinstance(value, dict) and key != "dn_meta":
            flat.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, d in enumerate(value):
                flat.update(_flat(d, f"{prefix}{key}.{i}."))
    return flat


def _published_model(code: str, size: str, image: tuple[int, int]):
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)
    from engine.core import YAMLConfig

    cfg = YAMLConfig(CONFIG.format(size), HGNetv2={"pretrained": False},
                     num_classes=NUM_CLASSES, eval_spatial_size=list(image),
                     DEIMTransformer={"num_queries": NUM_QUERIES, "num_denoising": NUM_DENOISING},
                     PostProcessor={"num_top_queries": TOP})
    model, post = cfg.model, cfg.postprocessor
    model = model.double()
    model.load_state_dict(deimv2_state_dict(model.state_dict()), strict=True)
    vit = model.backbone.dinov3
    (vit._model if hasattr(vit, "_model") else vit).rope_embed.dtype = F64
    return model.eval(), post


def _write_keys(code: str, size: str, commit: str, out_path: Path) -> None:
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)
    from engine.core import YAMLConfig

    model = YAMLConfig(CONFIG.format(size), HGNetv2={"pretrained": False}).model
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
    parser.add_argument("--size", choices=list("smlx"), required=True)
    parser.add_argument("--image", type=int, nargs=2, default=(128, 192), metavar=("H", "W"))
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
    with correctly_rounded_log():
        model, postprocessor = _published_model(args.code, args.size, tuple(args.image))
    x = images(*args.image)
    with torch.no_grad(), correctly_rounded_log():
        out = model(x)
    sizes_wh = torch.tensor([[640, 480], [333, 500]])
    results = postprocessor(out, sizes_wh)
    record = {
        "commit": args.commit, "config": CONFIG.format(args.size), "size": args.size,
        "image_shape": [BATCH, 3, *args.image], "num_classes": NUM_CLASSES,
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
