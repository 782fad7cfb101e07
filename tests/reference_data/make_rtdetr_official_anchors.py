"""Record the float32 anchors the RT-DETR reference data was made with
(``rtdetr_official_anchors.pt``, read by ``tests/official_numerics.py``). Not a test.

The published code computes the anchors in float32; their ``log`` differs in the last
bit between CPU kinds, and the data files ``rtdetr_official_r18.pt`` / ``_r50.pt`` hold
outputs computed with the anchors of the CPU that made them. This script computes the
anchors of each data file's input size with this machine's torch, runs this project's
model with them and saves them only if the eval outputs equal the data to 1e-14 in
float64 (one ulp of one selected anchor moves the boxes by about 1e-8): so the saved
anchors are the ones the data was made with. It succeeded on an AMD EPYC (Zen 3, AVX2);
on an Intel Xeon (AVX-512) the check fails (boxes 1.7e-8 apart).

    python tests/reference_data/make_rtdetr_official_anchors.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "models" / "rtdetr"))
from test_rtdetr_official import _images, _load, _model  # noqa: E402

from detr_irpe.models.hybrid import decoder  # noqa: E402

CASES = {"rtdetr_official_r18.pt": (18, 5), "rtdetr_official_r50.pt": (50, 10)}


def main() -> None:
    recorded: dict[str, torch.Tensor] = {}
    original = decoder.generate_anchors

    def recording(shapes, *args, **kwargs):
        anchors, valid = original(shapes, *args, **kwargs)
        recorded["x".join(f"{h}_{w}" for h, w in shapes)] = anchors.clone()
        return anchors, valid

    decoder.generate_anchors = recording
    for name, (depth, classes) in CASES.items():
        ref = _load(name)["eval"]
        model, _ = _model(depth, classes)
        with torch.no_grad():
            out = model(_images(ref["image_shape"]))
        for key in ("pred_logits", "pred_boxes"):
            diff = float((out[key] - ref[key]).abs().max())
            if diff > 1e-14:
                raise SystemExit(f"{name}: {key} differs by {diff:.1e}: this CPU's float32 "
                                 "log is not the one the data was made with; nothing saved")
    torch.save(recorded, HERE / "rtdetr_official_anchors.pt")
    print(f"saved {sorted(recorded)}")


if __name__ == "__main__":
    main()
