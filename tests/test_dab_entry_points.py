"""DAB-DETR and DN-DETR through the entry points DETR has: the Predictor and its
post-processing (the dab decoder's top-k sigmoid scores, no "no object" column)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import load_tiny_config

from detr_irpe.inference import Predictor
from detr_irpe.models import TopKPostProcess, build_model

NAMES = {1: "circle", 2: "square", 3: "triangle"}
# DAB-DETR, and DN-DETR (DAB-DETR trained with denoising queries; in eval mode its
# matching queries start from label_enc's extra row)
DECODERS = {
    "dab": ("model.decoder=dab",),
    "dn": ("model.decoder=dab", "model.denoising.enabled=true"),
}


def tiny_dab(decoder: str, *overrides: str):
    """``(model, cfg)``: a tiny DAB / DN model (4 classes, 4 queries) whose box head moves
    the boxes (its last layer starts at zero)."""
    torch.manual_seed(0)
    cfg = load_tiny_config("model.num_classes=4", *DECODERS[decoder], *overrides)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    with torch.no_grad():
        model.bbox_embed.layers[-1].weight.normal_(0.0, 0.3)
    return model.eval(), cfg


def _photo(height: int = 80, width: int = 120, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[10:40, 20:70] = (230, 30, 30)
    return pixels


def naive_top_k(logits: torch.Tensor, boxes: torch.Tensor, height: int, width: int, k: int):
    """The dab post-processing written out: every (query, class) sigmoid score, the k best;
    pair i is query i // C, class i % C; boxes cxcywh -> xyxy pixels."""
    num_classes = logits.shape[-1]
    pairs = sorted(((float(torch.sigmoid(logits[q, c])), q, c)
                    for q in range(logits.shape[0]) for c in range(num_classes)), reverse=True)
    scores, labels, xyxy = [], [], []
    for score, q, c in pairs[:k]:
        cx, cy, w, h = (float(v) for v in boxes[q])
        scores.append(score)
        labels.append(c)
        xyxy.append([(cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width,
                     (cy + h / 2) * height])
    return torch.tensor(scores), labels, torch.tensor(xyxy)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_predictor_uses_the_dab_post_processing(decoder: str) -> None:
    """Predictor(model, cfg) of a dab model: its TopKPostProcess, boxes in the input's
    pixels, every detection above the threshold, best first."""
    model, cfg = tiny_dab(decoder)
    predictor = Predictor(model, cfg, NAMES, device="cpu", score_threshold=0.0)
    assert isinstance(predictor.postprocessor, TopKPostProcess)
    pixels = _photo()
    result = predictor(pixels)
    with torch.no_grad():
        chw = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
        outputs = model([predictor.preprocess(chw)])
    # 4 queries x 4 classes = 16 pairs, fewer than num_select (300): all of them
    scores, labels, boxes = naive_top_k(outputs["pred_logits"][0], outputs["pred_boxes"][0],
                                        80, 120, k=16)
    assert len(result["scores"]) == 16
    torch.testing.assert_close(result["scores"], scores)
    assert result["labels"].tolist() == labels
    torch.testing.assert_close(result["boxes"], boxes)
    assert result["label_names"] == [NAMES.get(c, f"class {c}") for c in labels]
    # a threshold keeps the best ones
    kept = predictor(pixels, score_threshold=float(scores[2]))
    torch.testing.assert_close(kept["scores"], scores[:3])
