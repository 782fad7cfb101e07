"""List the state-dict keys of the published DEIMv2 detectors and of transformers'
``Deimv2ForObjectDetection`` built to match them, and run the published detectors for the
comparison with transformers' model (``deimv2_official_keys.json``,
``deimv2_hf_keys.json``, ``deimv2_hf_official_outputs.pt`` in this folder; read by
tests/models/deimv2/test_deimv2_hf_keys.py). Not a test, and not run by one: the
``official`` and ``outputs`` modes need a checkout of the published code
(github.com/Intellindust-AI-Lab/DEIMv2) outside this repository and the packages its
``engine`` imports (``scipy``, ``faster_coco_eval``, ``tensorboard``; ``calflops`` is
replaced by a dummy); the ``hf`` mode needs transformers 5 (``Deimv2ForObjectDetection``).
One size per process (the published config system keeps state between builds):

    for s in atto femto pico n s m l x; do
      python tests/reference_data/deimv2/make_deimv2_hf_keys.py --mode official --size $s \\
          --code PATH/TO/DEIMv2 --commit 0fff8d4 \\
          --out tests/reference_data/deimv2/deimv2_official_keys.json
      python tests/reference_data/deimv2/make_deimv2_hf_keys.py --mode hf --size $s \\
          --out tests/reference_data/deimv2/deimv2_hf_keys.json
      python tests/reference_data/deimv2/make_deimv2_hf_keys.py --mode outputs --size $s \\
          --code PATH/TO/DEIMv2 --commit 0fff8d4 \\
          --out tests/reference_data/deimv2/deimv2_hf_official_outputs.pt
    done

- ``official``: the published detector of ``configs/deimv2/deimv2_dinov3_{size}_coco.yml``
  (Atto to N: ``deimv2_hgnetv2_{size}_coco.yml``) as published (80 classes, the published
  eval size): every state-dict key with its shape, and the parameter count.
- ``hf``: ``Deimv2ForObjectDetection`` of the ``Deimv2Config`` that
  :func:`detr_irpe.models.deimv2.hf_keys.hf_deimv2_config` gives for the size (recorded
  with the keys): every key of its ``state_dict()`` (transformers 5's module names) with
  its shape, the parameter count, and the names ``save_pretrained`` writes (their number
  and :func:`saved_names_digest`; for S also the names that differ from the modules').
- ``outputs``: the published detector of the size, built for an eval size of
  :data:`IMAGE` (128 x 128) with :data:`QUERIES` queries (the anchors and the top-k are
  the only things these change; no key changes), in float64 with the weights of
  :func:`detector_state_dict` (a function of each key), in eval mode, on a seeded image:
  ``pred_logits`` and ``pred_boxes``. The RoPE tables are computed in float64 (the
  published code fixes them to float32; its ``rope_embed.dtype`` is set). The eval
  size keeps 80 tokens for Atto to N (strides 16 and 32), more than the queries.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
_WEIGHTS = ROOT / "tests" / "models" / "deimv2" / "deimv2_backbone_weights.py"

F64 = torch.float64
IMAGE = (1, 3, 128, 128)
QUERIES = 30
IMAGE_SEED = 0
HGNETV2_SIZES = ("atto", "femto", "pico", "n")
SIZES = ("s", "m", "l", "x", *HGNETV2_SIZES)
# entries kept as the model built them: constants and derived buffers, not weights
KEPT_LEAVES = ("up", "reg_scale", "num_points_scale", "anchors", "valid_mask")


@functools.cache
def _weights_module():
    spec = importlib.util.spec_from_file_location("deimv2_hf_backbone_weights", _WEIGHTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def detector_value(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float64 value of the published detector's entry ``key`` of ``shape``:
    ``deimv2_backbone_weights.backbone_value`` (the D-FINE tests' synthetic weights; the
    published RoPE periods; the DINOv3 key-bias mask 1 / 0 / 1)."""
    return _weights_module().backbone_value(key, shape)


def detector_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point entry but :data:`KEPT_LEAVES` replaced by
    :func:`detector_value` (in the entry's dtype); the others kept. Entries of one shared
    tensor (Atto to Pico's box head, one module for every layer) get the value of the
    first one's key."""
    out: dict[str, torch.Tensor] = {}
    first: dict[tuple, str] = {}
    for key, value in state.items():
        name = first.setdefault((value.data_ptr(), tuple(value.shape)), key) \
            if value.numel() else key
        out[key] = (detector_value(name, tuple(value.shape)).to(value.dtype)
                    if value.is_floating_point() and key.rsplit(".", 1)[-1] not in KEPT_LEAVES
                    else value.clone())
    return out


def image() -> torch.Tensor:
    """The seeded input (values in [0, 1], as after the published transforms' scaling;
    the ImageNet normalisation is the caller's and changes nothing compared here)."""
    return torch.rand(*IMAGE, generator=torch.Generator().manual_seed(IMAGE_SEED), dtype=F64)


def _published_path(code: str) -> None:
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)


def _published_model(size: str, **overrides):
    from engine.core import YAMLConfig

    kind = "hgnetv2" if size in HGNETV2_SIZES else "dinov3"
    path = f"configs/deimv2/deimv2_{kind}_{size}_coco.yml"
    return path, YAMLConfig(path, HGNetv2={"pretrained": False}, **overrides).model


def _keys(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in state.items()}


def official_record(size: str) -> dict:
    path, model = _published_model(size)
    return {"config": path, "parameters": sum(p.numel() for p in model.parameters()),
            "keys": _keys(model.state_dict())}


def hf_record(size: str) -> dict:
    import tempfile

    from safetensors.torch import load_file
    from transformers import Deimv2Config, Deimv2ForObjectDetection, __version__

    sys.path.insert(0, str(ROOT))
    from detr_irpe.models.deimv2.hf_keys import hf_deimv2_config

    settings = hf_deimv2_config(size)
    model = Deimv2ForObjectDetection(Deimv2Config(**settings))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        saved = load_file(str(Path(folder) / "model.safetensors"))
    state = model.state_dict()
    record = {"transformers": __version__, "config": settings,
              "parameters": sum(p.numel() for p in model.parameters()),
              "keys": _keys(state), "saved_count": len(saved),
              "saved_sha256": saved_names_digest(saved)}
    if size == "s":  # the file's names where they differ from the modules'
        record["saved_only"] = sorted(set(saved) - set(state))
        record["modules_only"] = sorted(set(state) - set(saved))
    return record


def saved_names_digest(names) -> str:
    """SHA-256 of the sorted names, one a line (what ``save_pretrained`` wrote)."""
    import hashlib

    return hashlib.sha256("".join(f"{n}\n" for n in sorted(names)).encode()).hexdigest()


def outputs_record(size: str) -> dict:
    _, model = _published_model(size, eval_spatial_size=list(IMAGE[2:]),
                                DEIMTransformer={"num_queries": QUERIES})
    model = model.double()
    model.load_state_dict(detector_state_dict(model.state_dict()), strict=True)
    vit = getattr(model.backbone, "dinov3", None)  # N: HGNetv2
    if vit is not None:
        (vit._model if hasattr(vit, "_model") else vit).rope_embed.dtype = F64
    model.eval()
    with torch.no_grad():
        out = model(image())
    return {"image_shape": list(IMAGE), "image_seed": IMAGE_SEED, "num_queries": QUERIES,
            "pred_logits": out["pred_logits"].detach().clone(),
            "pred_boxes": out["pred_boxes"].detach().clone()}


def _json(obj, indent: str = "") -> str:
    """JSON with one line per dictionary entry (a key list stays readable and small)."""
    if not isinstance(obj, dict) or not obj:
        return json.dumps(obj, separators=(",", ":"))
    inner = indent + " "
    rows = [f"{inner}{json.dumps(k)}: {_json(v, inner)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(rows) + "\n" + indent + "}"


def _merge(path: Path, size: str, record: dict, commit: str) -> None:
    """Put ``record`` under ``size`` in the file at ``path`` (JSON or .pt), atomically."""
    is_json = path.suffix == ".json"
    merged: dict = {}
    if path.exists():
        merged = (json.loads(path.read_text()) if is_json
                  else torch.load(path, weights_only=True))
    merged[size] = record
    if commit:
        merged["commit"] = commit
    merged = dict(sorted(merged.items()))
    tmp = path.with_suffix(path.suffix + ".tmp")
    if is_json:
        tmp.write_text(_json(merged) + "\n")
    else:
        torch.save(merged, tmp)
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("official", "hf", "outputs"), required=True)
    parser.add_argument("--size", choices=SIZES, required=True)
    parser.add_argument("--code", help="the published repository's folder (official, outputs)")
    parser.add_argument("--commit", default="", help="the published code's commit (recorded)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_path = Path(args.out).resolve()
    if args.mode == "hf":
        _merge(out_path, args.size, hf_record(args.size), "")
        return
    if not args.code:
        parser.error(f"--mode {args.mode} needs --code")
    _published_path(args.code)
    record = official_record(args.size) if args.mode == "official" else outputs_record(args.size)
    _merge(out_path, args.size, record, args.commit)


if __name__ == "__main__":
    main()
