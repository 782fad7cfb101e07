"""Run parts of the published DEIMv2 code on the CPU and save what
``tests/models/deimv2/test_deimv2_parts_official.py`` and ``tests/data/test_copyblend.py``
compare against (``tests/reference_data/deimv2/deimv2_*_official.pt`` and
``deimv2_parts_official_keys.json``). Not a test, and not run by one: it needs a checkout
of the published code (github.com/Intellindust-AI-Lab/DEIMv2) outside this repository,
and ``scipy``, ``faster_coco_eval`` and ``tensorboard``, which the published package
imports.

    python tests/reference_data/make_deimv2_parts_official.py --code /tmp/DEIMv2 \\
        --out tests/reference_data/deimv2
    python tests/reference_data/make_deimv2_parts_official.py --code /tmp/DEIMv2 \\
        --out tests/reference_data/deimv2 --published-keys

The parts, small and seeded (float64 unless said):

- ``sta``: the spatial tuning adapter (``SpatialPriorModulev2``, 4 planes) on a
  2 x 3 x 32 x 64 image, and ``DINOv3STAs``' fusion (ViT-Tiny, width 32, outputs of width
  24) of three given ViT token maps with it;
- ``encoder``: ``HybridEncoder`` as S (``version: deim``, ``csp2``, ``fuse_op: sum``,
  three levels of width 32) and as N (``version: dfine``, ``csp2``, ``sum``, two levels
  projected from 48 and 64 channels), ``LiteEncoder`` (one input of 40 channels);
- ``decoder``: the decoder layer (width 32, 4 heads, FFN 64, points 3 / 6 / 3) with and
  without the gateway, on given queries, boxes, memory, position embedding and a
  self-attention mask: outputs and the gradients of one scalar (the output weighted by
  fixed numbers) with respect to the inputs and the parameters (all of them with the
  gateway, the norms' without); ``query_pos_head`` and
  ``RMSNorm`` alone (on inputs whose mean square is about 9 and about 1e-6, near its eps);
- ``matcher``: the published matcher (cost weights 2 / 5 / 2, focal, switch at epoch 5,
  alpha 4) on float32 predictions, at epochs 4 and 5: the matches and the cost matrices;
- ``copyblend``: the collate function's CopyBlend (probability 1, MixUp off) on a float32
  batch of 3 images 32 x 48 for Python ``random`` seeds 0, 1, 2 (context growth on) and 6
  (also a random object count: 2, 1 and 2 objects).

Weights: ``dfine_weights.synthetic_state_dict`` of each built module (a function of each
key), loaded strictly; the modules in eval mode. The keys file lists each module's
state-dict keys and shapes.

``--published-keys`` builds the published detectors instead (DINOv3 S, M, L, X; HGNetv2
Atto and N; one per process, random weights, nothing downloaded) and saves, with each
one's settings of the STA, the encoder and the decoder, the keys and shapes of these
parts at the published widths (``deimv2_parts_published_keys.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "models" / "dfine"))
from dfine_weights import synthetic_state_dict  # noqa: E402

F64 = torch.float64
IMAGE = (2, 3, 32, 64)  # the STA's image: ViT grid 2 x 4
SHAPES = [(8, 12), (4, 6), (2, 3)]  # the encoder's maps
DEC_SHAPES = [(4, 6), (2, 3), (1, 2)]  # the decoder's memory
WIDTH, HEADS, FFN, QUERIES = 32, 4, 64, 7
COPY_IMAGES = (3, 3, 32, 48)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _import_published(code: str) -> None:
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)


def _prepared(module: torch.nn.Module) -> torch.nn.Module:
    module.load_state_dict(synthetic_state_dict(module.state_dict()), strict=True)
    return module.double().eval()


def _keys(module: torch.nn.Module) -> list:
    return [[k, list(v.shape)] for k, v in module.state_dict().items()]


def sta_part(keys: dict) -> dict:
    from engine.backbone.dinov3_adapter import DINOv3STAs, SpatialPriorModulev2

    sta = _prepared(SpatialPriorModulev2(inplanes=4))
    image = torch.rand(*IMAGE, generator=_gen(1), dtype=F64)
    with torch.no_grad():
        sta_out = list(sta(image))
    full = DINOv3STAs(name="vit_tiny", interaction_indexes=[3, 7, 11], embed_dim=WIDTH,
                      num_heads=2, conv_inplane=4, hidden_dim=24)
    # the ViT's keys (dinov3.*) are the backbone's data, not these parts'
    keys["DINOv3STAs(vit_tiny, embed_dim 32, conv_inplane 4, hidden_dim 24)"] = [
        k for k in _keys(full) if not k[0].startswith("dinov3.")]
    h, w = IMAGE[2] // 16, IMAGE[3] // 16
    tokens = [torch.randn(IMAGE[0], h * w, WIDTH, generator=_gen(10 + i), dtype=F64)
              for i in range(3)]

    class GivenTokens(torch.nn.Module):  # stands in for the ViT: returns the given tokens
        embed_dim = WIDTH

        def get_intermediate_layers(self, x, n, return_class_token):
            return [(t, None) for t in tokens]

    full.dinov3 = GivenTokens()
    full = _prepared(full)
    with torch.no_grad():
        fused = list(full(image))
    maps = [t.transpose(1, 2).reshape(IMAGE[0], WIDTH, h, w) for t in tokens]
    return {"image": image, "sta_out": sta_out, "vit_maps": maps, "fused": fused}


def encoder_part(keys: dict) -> dict:
    from engine.deim.hybrid_encoder import HybridEncoder
    from engine.deim.lite_encoder import LiteEncoder

    settings = {
        "s": dict(in_channels=[WIDTH] * 3, feat_strides=[8, 16, 32], hidden_dim=WIDTH, nhead=HEADS,
                  dim_feedforward=FFN, expansion=0.34, depth_mult=0.67, version="deim",
                  csp_type="csp2", fuse_op="sum"),
        "n": dict(in_channels=[48, 64], feat_strides=[16, 32], hidden_dim=WIDTH, nhead=HEADS,
                  dim_feedforward=FFN, use_encoder_idx=[1], expansion=0.34, depth_mult=0.5,
                  version="dfine", csp_type="csp2", fuse_op="sum"),
    }
    record = {}
    for name, kwargs in settings.items():
        enc = HybridEncoder(**kwargs)
        keys[f"HybridEncoder({name})"] = _keys(enc)
        enc = _prepared(enc)
        shapes = SHAPES if name == "s" else SHAPES[1:]
        feats = [torch.randn(2, c, *s, generator=_gen(20 + i), dtype=F64)
                 for i, (c, s) in enumerate(zip(kwargs["in_channels"], shapes))]
        with torch.no_grad():
            out = enc(feats)
        record[name] = {"settings": kwargs, "feats": feats, "out": out}
    lite = LiteEncoder(in_channels=[40], feat_strides=[16], hidden_dim=WIDTH, expansion=0.34,
                       depth_mult=0.5)
    keys["LiteEncoder"] = _keys(lite)
    lite = _prepared(lite)
    feats = [torch.randn(2, 40, 4, 6, generator=_gen(30), dtype=F64)]
    with torch.no_grad():
        out = lite(feats)
    record["lite"] = {"settings": dict(in_channels=[40], hidden_dim=WIDTH, expansion=0.34,
                                       depth_mult=0.5), "feats": feats, "out": out}
    return record


def decoder_part(keys: dict) -> dict:
    from engine.deim.deim_decoder import TransformerDecoderLayer
    from engine.deim.deim_utils import MLP, RMSNorm

    batch = 2
    length = sum(h * w for h, w in DEC_SHAPES)
    inputs = {
        "target": torch.randn(batch, QUERIES, WIDTH, generator=_gen(40), dtype=F64),
        "reference": torch.rand(batch, QUERIES, 1, 4, generator=_gen(41), dtype=F64) * 0.6 + 0.2,
        "memory": torch.randn(batch, length, WIDTH, generator=_gen(42), dtype=F64),
        "query_pos": torch.randn(batch, QUERIES, WIDTH, generator=_gen(43), dtype=F64),
        "weights": torch.randn(batch, QUERIES, WIDTH, generator=_gen(44), dtype=F64),
        "attn_mask": torch.rand(QUERIES, QUERIES, generator=_gen(45)) < 0.3,
    }
    inputs["attn_mask"].fill_diagonal_(False)
    record = {"inputs": inputs, "shapes": DEC_SHAPES}
    for gateway in (True, False):
        layer = TransformerDecoderLayer(WIDTH, HEADS, FFN, 0.0, "silu", 3, [3, 6, 3],
                                        use_gateway=gateway)
        keys[f"TransformerDecoderLayer(use_gateway={gateway})"] = _keys(layer)
        layer = _prepared(layer)
        leaves = {k: inputs[k].clone().requires_grad_(True)
                  for k in ("target", "memory", "query_pos")}
        value = leaves["memory"].reshape(batch, length, HEADS, -1).permute(0, 2, 3, 1)
        value = value.split([h * w for h, w in DEC_SHAPES], dim=-1)
        out = layer(leaves["target"], inputs["reference"], value, DEC_SHAPES, inputs["attn_mask"],
                    leaves["query_pos"])
        (out * inputs["weights"]).sum().backward()
        record[f"gateway_{gateway}"] = {
            "out": out.detach(),
            "input_grads": {k: v.grad for k, v in leaves.items()},
            # every parameter's with the gate; without it the norms' (the rest is the same)
            "param_grads": {k: p.grad for k, p in layer.named_parameters()
                            if gateway or "norm" in k},
        }
    head = MLP(4, WIDTH, WIDTH, 3, act="silu")
    keys["query_pos_head"] = _keys(head)
    head = _prepared(head)
    ref_unact = torch.randn(batch, QUERIES, 4, generator=_gen(46), dtype=F64) * 3
    with torch.no_grad():
        record["query_pos"] = {"ref_unact": ref_unact,
                               "out": head(torch.sigmoid(ref_unact)).clamp(min=-10, max=10)}
    norm = _prepared(RMSNorm(WIDTH))
    with torch.no_grad():
        # at 1e-3 the mean square is near eps (1e-6), which then shows
        record["rms_norm"] = {"scales": [3.0, 1e-3],
                              "out": [norm(inputs["target"] * s) for s in (3.0, 1e-3)]}
    return record


def matcher_part() -> dict:
    import engine.deim.matcher as published

    matcher = published.HungarianMatcher(
        weight_dict={"cost_class": 2, "cost_bbox": 5, "cost_giou": 2}, use_focal_loss=True,
        alpha=0.25, gamma=2.0, change_matcher=True, iou_order_alpha=4.0, matcher_change_epoch=5)
    boxes = torch.rand(2, 30, 4, generator=_gen(50))
    boxes[..., 2:] = boxes[..., 2:] * 0.5 + 0.05
    boxes[0, :3, 2] = -0.05  # FDR boxes may be inverted: read as width 0
    outputs = {"pred_logits": torch.randn(2, 30, 5, generator=_gen(51)) * 2,
               "pred_boxes": boxes}
    targets = [{"labels": torch.tensor([1, 4, 0]),
                "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.3], [0.25, 0.3, 0.2, 0.25],
                                       [0.7, 0.6, 0.1, 0.3]])},
               {"labels": torch.tensor([2]), "boxes": torch.tensor([[0.4, 0.55, 0.5, 0.6]])}]
    costs = []
    original = published.linear_sum_assignment

    def recording(c):
        costs[-1].append(torch.as_tensor(c).clone())
        return original(c)

    published.linear_sum_assignment = recording
    record = {"outputs": outputs, "targets": targets, "change_epoch": 5, "alpha": 4.0}
    for epoch in (4, 5):
        costs.append([])
        record[f"epoch_{epoch}"] = {"indices": matcher(outputs, targets, epoch=epoch)["indices"],
                                    "costs": costs[-1]}
    published.linear_sum_assignment = original
    return record


def copyblend_batch_inputs() -> tuple[torch.Tensor, list[dict]]:
    """The float32 batch: three images, six objects, one of area below 100."""
    images = torch.rand(*COPY_IMAGES, generator=_gen(60))
    height, width = COPY_IMAGES[2:]
    boxes = [torch.tensor([[0.3, 0.4, 0.4, 0.5], [0.8, 0.2, 0.1, 0.1], [0.5, 0.7, 0.5, 0.6]]),
             torch.tensor([[0.2, 0.3, 0.3, 0.45]]),
             torch.tensor([[0.7, 0.6, 0.5, 0.7], [0.1, 0.9, 0.15, 0.2]])]
    targets = [{"boxes": b, "labels": torch.arange(len(b)) + 10 * i,
                "area": b[:, 2] * b[:, 3] * (height * width)} for i, b in enumerate(boxes)]
    return images, targets


def copyblend_part() -> dict:
    from engine.data.dataloader import BatchImageCollateFunction

    vis = tempfile.mkdtemp() + "/"
    images, targets = copyblend_batch_inputs()
    record = {"images": images, "targets": targets, "cases": []}
    for seed in (0, 1, 2, 6):
        collate = BatchImageCollateFunction(
            copyblend_prob=1.0, copyblend_epochs=[0, 100], area_threshold=100, num_objects=3,
            with_expand=True, expand_ratios=[0.1, 0.25], random_num_objects=seed == 6,
            vis_save=vis)
        collate.set_epoch(1)
        images, targets = copyblend_batch_inputs()
        random.seed(seed)
        out, new = collate.apply_mixup(images, targets)
        record["cases"].append({
            "seed": seed, "random_count": seed == 6, "images": out,
            "targets": [{k: t[k] for k in ("boxes", "labels", "area")} for t in new]})
    return record


PUBLISHED = {"s": "deimv2_dinov3_s", "m": "deimv2_dinov3_m", "l": "deimv2_dinov3_l",
             "x": "deimv2_dinov3_x", "atto": "deimv2_hgnetv2_atto", "n": "deimv2_hgnetv2_n"}
# the parts' prefixes in the published detector
PREFIXES = ("backbone.sta.", "backbone.convs.", "backbone.norms.", "encoder.",
            "decoder.decoder.layers.0.", "decoder.query_pos_head.")


def published_keys(size: str) -> dict:
    """The settings and the parts' keys of one published detector (one per process)."""
    from engine.core import YAMLConfig

    cfg = YAMLConfig(f"configs/deimv2/{PUBLISHED[size]}_coco.yml", HGNetv2={"pretrained": False})
    state = cfg.model.state_dict()
    sections = ("DINOv3STAs", "HybridEncoder", "LiteEncoder", "DEIMTransformer")
    settings = {name: {k: v for k, v in cfg.yaml_cfg[name].items()
                       if isinstance(v, (int, float, str, bool, list)) or v is None}
                for name in sections if name in cfg.yaml_cfg}
    settings["encoder"] = cfg.yaml_cfg["DEIM"]["encoder"]
    settings["backbone"] = cfg.yaml_cfg["DEIM"]["backbone"]
    vit = getattr(cfg.model.backbone, "dinov3", None)
    settings["vit_embed_dim"] = None if vit is None else vit.embed_dim
    keys = [[k, list(v.shape)] for k, v in state.items() if k.startswith(PREFIXES)]
    return {"config": PUBLISHED[size], "settings": settings, "keys": keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", required=True, help="the published repository's folder")
    parser.add_argument("--out", required=True, help="the folder of the data files")
    parser.add_argument("--published-keys", action="store_true",
                        help="the parts' keys of the published detectors instead")
    parser.add_argument("--size", choices=sorted(PUBLISHED), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.published_keys and args.size is None:  # one process per detector
        import subprocess
        record = {}
        for size in PUBLISHED:
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, __file__, "--code", args.code, "--out", tmp,
                                "--published-keys", "--size", size], check=True,
                               stdout=subprocess.DEVNULL)
                record[size] = json.loads((Path(tmp) / "one.json").read_text())
        (out / "deimv2_parts_published_keys.json").write_text(json.dumps(record, indent=0))
        return
    _import_published(args.code)
    if args.size is not None:
        (out / "one.json").write_text(json.dumps(published_keys(args.size)))
        return
    keys: dict = {}
    torch.save(sta_part(keys), out / "deimv2_sta_official.pt")
    torch.save(encoder_part(keys), out / "deimv2_encoder_official.pt")
    torch.save(decoder_part(keys), out / "deimv2_decoder_official.pt")
    torch.save(matcher_part(), out / "deimv2_matcher_official.pt")
    torch.save(copyblend_part(), out / "deimv2_copyblend_official.pt")
    (out / "deimv2_parts_official_keys.json").write_text(json.dumps(keys, indent=0))


if __name__ == "__main__":
    main()
