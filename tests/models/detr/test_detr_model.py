"""The assembled DETR: shapes, finite losses / gradients, backbone options, plain-DETR weights."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torchvision
from helpers import assert_close_to_scale, load_tiny_config
from torch.testing import assert_close

from detr_irpe.checkpoint import load_weights
from detr_irpe.config import Config, ConfigError, ModelConfig
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.errors import CheckpointError
from detr_irpe.models import FrozenBatchNorm2d, PostProcess, build_model
from detr_irpe.models.backbone import Backbone
from detr_irpe.models.detr.transformer import Transformer
from detr_irpe.structures import ImageBatch

# On top of the tiny config: two decoder layers, so that there is an auxiliary output; a
# class count of its own, as no dataset is read here (targets use labels 0..3); and six
# queries, a count unlike any other axis (4 heads, 4 box coordinates, 5 logits), so that
# a swapped axis shows in the shapes.
MODEL = ("model.dec_layers=2", "model.num_classes=4", "model.num_queries=6")


def tiny_cfg(*overrides: str) -> Config:
    return load_tiny_config(*MODEL, *overrides)


def tiny(*overrides: str):
    return build_model(tiny_cfg(*overrides))


def images() -> list[torch.Tensor]:
    return [torch.randn(3, 96, 128), torch.randn(3, 64, 96)]


def targets() -> list[dict]:
    return [
        {
            "labels": torch.tensor([1, 3]),
            "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.4], [0.2, 0.3, 0.1, 0.2]]),
        },
        {"labels": torch.tensor([0]), "boxes": torch.tensor([[0.6, 0.4, 0.5, 0.5]])},
    ]


@pytest.mark.parametrize(
    "rpe",
    [
        "none",
        "rpe-1.9-euc-bias-1-qk",
        "rpe-1.9-euc-ctx-0-qkv",
        "rpe-1.9-quant-bias-0-k",
        "rpe-1.9-quant-ctx-1-qkv",
        "rpe-1.9-cross-bias-0-qk",
        "rpe-1.9-cross-ctx-1-qkv",
        "rpe-2.0-product-bias-1-q",
        "rpe-2.0-product-ctx-1-k",
        "rpe-2.0-product-ctx-0-qkv",
    ],
)
def test_every_irpe_variant_trains(rpe: str) -> None:
    model, criterion, _ = tiny(f"model.rpe={rpe}", "model.frozen_bn=false")
    queries = tiny_cfg().model.num_queries
    heads = {}
    for name in ("class_embed", "bbox_embed"):
        getattr(model, name).register_forward_hook(
            lambda module, args, output, name=name: heads.__setitem__(name, output.detach()))
    out = model(images())
    assert out["pred_logits"].shape == (2, queries, 5)
    assert out["pred_boxes"].shape == (2, queries, 4)
    assert len(out["aux_outputs"]) == 1
    assert out["aux_outputs"][0]["pred_boxes"].shape == (2, queries, 4)
    # the heads of the last decoder layer are the prediction, the earlier one's the
    # auxiliary output; boxes are the sigmoid of the box head
    logits, raw_boxes = heads["class_embed"], heads["bbox_embed"]
    assert logits.shape[0] == raw_boxes.shape[0] == 2  # (decoder layers, B, Q, ...)
    assert torch.equal(out["pred_logits"], logits[1])
    assert torch.equal(out["aux_outputs"][0]["pred_logits"], logits[0])
    assert_close(out["pred_boxes"], raw_boxes[1].sigmoid())  # elementwise: ulps apart at most
    assert_close(out["aux_outputs"][0]["pred_boxes"], raw_boxes[0].sigmoid())
    losses = criterion(out, targets())
    assert set(criterion.weight_dict) <= set(losses)
    total = sum(losses[k] * w for k, w in criterion.weight_dict.items())
    assert torch.isfinite(total)
    total.backward()
    tables = [(n, p) for n, p in model.named_parameters() if ".rpe_" in n]
    assert (len(tables) > 0) == (rpe != "none")
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, name
            assert torch.isfinite(param.grad).all(), name
    for name, param in tables:
        assert param.grad.abs().sum() > 0, f"{name} gets no gradient"


def test_image_batch_equals_list_and_padding() -> None:
    model, _, _ = tiny("model.backbone_stages=4")  # stride 32
    model.eval()
    imgs = images()
    batch = ImageBatch.from_images(imgs)
    with torch.no_grad():
        a, b = model(imgs), model(batch)
    assert_close(a["pred_logits"], b["pred_logits"])
    # the feature mask is the nearest-downsampled pixel mask: image 1 covers 2 x 3 of 3 x 4 cells
    features, mask, pos = model.backbone(batch)
    assert features.shape[-2:] == (3, 4) and mask.shape == (2, 3, 4)
    assert mask[1].tolist() == [[False, False, False, True]] * 2 + [[True] * 4]
    assert pos.shape == (2, 32, 3, 4)


def test_plain_detr_weights_give_identical_outputs(tmp_path) -> None:
    """With rpe_init=zero, plain DETR weights in an iRPE model compute the plain DETR;
    with xavier the loader leaves the model's fresh random tables as they are."""
    torch.manual_seed(1)
    plain, _, _ = tiny("model.rpe=none")
    path = tmp_path / "plain.pth"
    torch.save({"model": plain.state_dict(), "args": {}}, path)
    torch.manual_seed(2)
    irpe, _, _ = tiny("model.rpe=rpe-2.0-product-ctx-0-qkv", "model.rpe_init=zero")
    info = load_weights(irpe, path)
    assert info["format"] == "detr"
    assert len(info["missing"].get("irpe", [])) == 3  # rpe_q, rpe_k, rpe_v of the one encoder layer
    plain.eval()
    irpe.eval()
    imgs = images()
    with torch.no_grad():
        a, b = plain(imgs), irpe(imgs)
    assert_close(a["pred_logits"], b["pred_logits"], atol=1e-5, rtol=1e-5)
    assert_close(a["pred_boxes"], b["pred_boxes"], atol=1e-5, rtol=1e-5)

    xavier, _, _ = tiny("model.rpe=rpe-2.0-product-ctx-0-qkv", "model.rpe_init=xavier")
    before = {k: v.clone() for k, v in xavier.state_dict().items() if ".rpe_" in k}
    load_weights(xavier, path)
    after = xavier.state_dict()
    for key, value in before.items():
        assert value.abs().sum() > 0 and torch.equal(after[key], value), key


def test_pre_norm_variant() -> None:
    model, criterion, _ = tiny("model.pre_norm=true")
    keys = model.state_dict().keys()
    assert "transformer.encoder.norm.weight" in keys
    post, _, _ = tiny()
    assert "transformer.encoder.norm.weight" not in post.state_dict()
    out = model(images())
    total = sum(
        v * criterion.weight_dict[k]
        for k, v in criterion(out, targets()).items()
        if k in criterion.weight_dict
    )
    total.backward()
    assert torch.isfinite(total)


def test_no_aux_loss_and_zero_encoder_layers() -> None:
    model, criterion, _ = tiny("model.aux_loss=false", "model.enc_layers=0")
    out = model(images())
    assert "aux_outputs" not in out
    assert "loss_ce_0" not in criterion(out, targets())


def test_backbone_freezing_and_frozen_bn() -> None:
    model, _, _ = tiny("model.freeze_stem=true")
    trainable = {n for n, p in model.backbone.named_parameters() if p.requires_grad}
    assert "0.body.conv1.weight" not in trainable
    assert not any(".layer1." in n for n in trainable)
    assert "0.body.layer2.0.conv1.weight" in trainable
    assert isinstance(model.backbone[0].body.bn1, FrozenBatchNorm2d)
    assert not any("num_batches_tracked" in k for k in model.state_dict())
    # build_model reads no training section: lr_backbone=0 freezes through the optimizer
    cfg = tiny_cfg("train.lr_backbone=0")
    frozen, _, _ = build_model(cfg)
    build_optimizer(frozen, cfg.train)
    assert not any(p.requires_grad for p in frozen.backbone.parameters())
    assert any(p.requires_grad for p in frozen.transformer.parameters())
    trained, _, _ = tiny("model.frozen_bn=false", "model.freeze_stem=false")
    assert trained.backbone[0].body.bn1.weight.requires_grad
    assert trained.backbone[0].body.conv1.weight.requires_grad


def test_frozen_bn_formula() -> None:
    bn = FrozenBatchNorm2d(3)
    bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
    bn.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
    bn.running_mean.copy_(torch.tensor([0.1, 0.2, 0.3]))
    bn.running_var.copy_(torch.tensor([1.0, 4.0, 0.25]))
    ref = torch.nn.BatchNorm2d(3, eps=1e-5).eval()
    ref.load_state_dict(bn.state_dict(), strict=False)
    x = torch.randn(2, 3, 4, 5)
    assert_close(bn(x), ref(x))
    # a trainable-BN state dict (with num_batches_tracked) loads into the frozen one
    bn.load_state_dict(ref.state_dict())


def test_frozen_bn_against_torchvision() -> None:
    """Same outputs, keys and loading as torchvision.ops.FrozenBatchNorm2d; only the
    output dtype for bf16 inputs differs (the reason to keep ours)."""
    import torchvision

    ours, theirs = FrozenBatchNorm2d(4), torchvision.ops.FrozenBatchNorm2d(4)
    trained = torch.nn.BatchNorm2d(4)
    trained.train()
    trained(torch.randn(8, 4, 5, 5) * 3 + 1)  # non-trivial running statistics
    with torch.no_grad():
        trained.weight.uniform_(0.5, 2.0)
        trained.bias.uniform_(-1.0, 1.0)
    state = trained.state_dict()
    assert "num_batches_tracked" in state
    ours.load_state_dict(state)
    theirs.load_state_dict(state)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(2, 4, 6, 7)
    assert_close(ours(x), theirs(x), rtol=0, atol=0)
    assert_close(ours(x), trained.eval()(x))
    x16 = x.bfloat16()
    assert ours(x16).dtype == torch.bfloat16 and theirs(x16).dtype == torch.float32


def test_dilation_output_stride() -> None:
    x = torch.randn(1, 3, 64, 96)
    mask = torch.zeros(1, 64, 96, dtype=torch.bool)
    for name in ("resnet18", "resnet50"):
        plain = Backbone(name, dilation=False)
        dc5 = Backbone(name, dilation=True)
        assert plain(x, mask)[0].shape[-2:] == (2, 3)
        feat, feat_mask = dc5(x, mask)
        assert feat.shape[-2:] == (4, 6) and feat_mask.shape == (1, 4, 6)
        assert dc5.stride == 16
        assert plain.state_dict().keys() == dc5.state_dict().keys()


@pytest.mark.parametrize(("name", "stages", "channels", "stride"), [
    ("resnet18", 2, 128, 8), ("resnet18", 3, 256, 16), ("resnet18", 4, 512, 32),
    ("resnet50", 2, 512, 8),
])
def test_backbone_stages_end_where_torchvision_s_layers_end(
    name: str, stages: int, channels: int, stride: int,
) -> None:
    """``model.backbone_stages``: the body is torchvision's ResNet up to ``layer{stages}``,
    with the channels and stride of that layer."""
    backbone = Backbone(name, weights=None, frozen_bn=False, stages=stages).eval()
    reference = getattr(torchvision.models, name)().eval()
    reference.load_state_dict(backbone.body.state_dict(), strict=False)
    assert (backbone.num_channels, backbone.stride) == (channels, stride)
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        features, mask = backbone(x, torch.zeros(2, 64, 96, dtype=torch.bool))
        expected = reference.maxpool(reference.relu(reference.bn1(reference.conv1(x))))
        for layer in range(1, stages + 1):
            expected = getattr(reference, f"layer{layer}")(expected)
    assert features.shape == (2, channels, 64 // stride, 96 // stride)
    assert mask.shape == (2, 64 // stride, 96 // stride)
    assert_close(features, expected)


def test_random_init_warning_and_local_weights(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        source = Backbone("resnet18", weights="none")
    assert "RANDOM" in caplog.text
    import torchvision

    net = torchvision.models.resnet18()
    path = tmp_path / "r18.pth"
    torch.save(net.state_dict(), path)
    loaded = Backbone("resnet18", weights=str(path))
    assert_close(loaded.body.conv1.weight, net.conv1.weight)
    assert_close(loaded.body.layer4[1].bn2.running_var, net.layer4[1].bn2.running_var)
    del source
    with pytest.raises(CheckpointError, match="not found"):
        Backbone("resnet18", weights=str(tmp_path / "missing.pth"))
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match="not a resnet18 state dict"):
        Backbone("resnet18", weights=str(tmp_path / "bad.pth"))


def test_num_classes_required() -> None:
    cfg = load_tiny_config()
    assert cfg.model.num_classes is None
    with pytest.raises(ConfigError, match="model.num_classes"):
        build_model(cfg)


def test_postprocess() -> None:
    logits = torch.tensor([[[0.0, 2.0, 5.0], [3.0, 1.0, 0.0]]])
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.4], [0.25, 0.75, 0.5, 0.5]]])
    out = PostProcess()({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[200, 100]]))
    assert len(out) == 1
    prob = logits.softmax(-1)[0]
    assert_close(out[0]["scores"], torch.stack([prob[0, 1], prob[1, 0]]))
    assert out[0]["labels"].tolist() == [1, 0]
    # width 100, height 200: (0.4*100, 0.3*200, 0.6*100, 0.7*200)
    assert_close(
        out[0]["boxes"], torch.tensor([[40.0, 60.0, 60.0, 140.0], [0.0, 100.0, 50.0, 200.0]])
    )


def test_frozen_trainable_bn_keeps_statistics() -> None:
    backbone = Backbone("resnet18", frozen_bn=False, train_backbone=True, freeze_stem=True)
    backbone.train()
    assert not backbone.body.bn1.training and backbone.body.layer2[0].bn1.training
    before = backbone.body.bn1.running_mean.clone()
    backbone(torch.randn(2, 3, 64, 64), torch.zeros(2, 64, 64, dtype=torch.bool))
    assert torch.equal(backbone.body.bn1.running_mean, before)


@pytest.mark.parametrize("kind", ["learned", "none"])
def test_other_position_embeddings(kind: str) -> None:
    model, criterion, _ = tiny(f"model.position_embedding={kind}")
    out = model(images())
    losses = criterion(out, targets())
    assert all(torch.isfinite(v) for v in losses.values())
    if kind == "learned":
        assert "backbone.1.row_embed.weight" in model.state_dict()


def test_imagenet_download_failure_is_clear(monkeypatch) -> None:
    import torchvision

    def offline(**kwargs):
        raise OSError("Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.models, "resnet18", offline)
    with pytest.raises(CheckpointError, match="TORCH_HOME"):
        Backbone("resnet18", weights="imagenet")


def xavier_bound(shape: tuple[int, ...]) -> float:
    """``xavier_uniform_``'s bound for a tensor of this shape, from the definition:
    fan_in = size(1) * receptive field, fan_out = size(0) * receptive field, where the
    receptive field is the product of the sizes after the first two."""
    receptive = 1
    for size in shape[2:]:
        receptive *= size
    fan_in, fan_out = shape[1] * receptive, shape[0] * receptive
    return math.sqrt(6.0 / (fan_in + fan_out))


@pytest.mark.parametrize(
    "rpe",
    ["rpe-2.0-product-ctx-1-k", "rpe-2.0-product-ctx-0-qkv", "rpe-2.0-product-bias-0-qk",
     "rpe-1.9-cross-ctx-1-qkv", "rpe-1.9-euc-bias-1-k"],
)
def test_rpe_tables_start_like_the_reference(rpe: str) -> None:
    """xavier: every table uniform in +-bound of its own shape (std bound / sqrt(3));
    zero: all zeros."""
    transformer = Transformer(
        d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=1,
        dim_feedforward=64, encodings=[rpe], rpe_init="xavier",
    )
    tables = [(n, p.detach()) for n, p in transformer.named_parameters() if "lookup_table" in n]
    assert len(tables) >= 2
    for name, table in tables:
        bound = xavier_bound(tuple(table.shape))
        assert table.abs().max() <= bound, name
        if table.numel() >= 200:  # enough values for the spread to be that of U(-b, b)
            assert abs(table.std().item() / (bound / math.sqrt(3)) - 1) < 0.15, name
    # each layer's tables are drawn separately
    assert not torch.equal(tables[0][1], tables[len(tables) // 2][1])
    zero = Transformer(
        d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=1,
        dim_feedforward=64, encodings=[rpe], rpe_init="zero",
    )
    for name, param in zero.named_parameters():
        if "lookup_table" in name:
            assert not param.detach().any(), name


def test_rpe_init_from_the_config() -> None:
    zero, _, _ = tiny("model.rpe_init=zero")
    xavier, _, _ = tiny()  # the default
    assert tiny_cfg().model.rpe_init == ModelConfig().rpe_init == "xavier"
    for model, started in ((zero, False), (xavier, True)):
        tables = [p for n, p in model.named_parameters() if "lookup_table" in n]
        assert tables and all(bool(t.detach().any()) == started for t in tables)
    with pytest.raises(ConfigError, match="model.rpe_init.*xavier, zero"):
        tiny_cfg("model.rpe_init=normal")


def test_backbone_weights_from_a_local_state_dict(tmp_path) -> None:
    import torchvision

    from detr_irpe.errors import CheckpointError
    from detr_irpe.models.backbone import Backbone

    # a torchvision ResNet-18 state dict as people save it: classifier and BatchNorm
    # step counters included, under DDP's "module." prefix
    reference = torchvision.models.resnet18()
    state = {f"module.{k}": v for k, v in reference.state_dict().items()}
    good = tmp_path / "resnet18.pth"
    torch.save(state, good)
    backbone = Backbone("resnet18", str(good), frozen_bn=False, freeze_stem=False)
    for key, value in backbone.body.state_dict().items():
        if not key.endswith("num_batches_tracked"):
            torch.testing.assert_close(value, reference.state_dict()[key], rtol=0, atol=0)

    # another network's weights: one line naming what does not fit
    wrong = tmp_path / "resnet34.pth"
    torch.save(torchvision.models.resnet34().state_dict(), wrong)
    with pytest.raises(CheckpointError) as err:
        Backbone("resnet18", str(wrong))
    text = str(err.value)
    assert "is not a resnet18 state dict" in text and "unexpected" in text
    assert "\n" not in text


def test_channels_last_follows_the_batch_norm() -> None:
    """auto: NHWC with frozen BN, NCHW with trainable BN; true / false force it."""
    def layout(*overrides: str) -> bool:
        model, _, _ = tiny(*overrides)
        return model.backbone[0].channels_last

    assert layout("model.frozen_bn=true") is True
    assert layout("model.frozen_bn=false") is False
    assert layout("model.frozen_bn=false", "model.channels_last=true") is True
    assert layout("model.frozen_bn=true", "model.channels_last=false") is False
    with pytest.raises(ConfigError, match="model.channels_last must be true, false or auto"):
        tiny_cfg("model.channels_last=sometimes")


def test_channels_last_computes_the_same_model(tmp_path) -> None:
    """model.channels_last changes the memory layout only: the same weights give the same
    outputs, loss gradients and checkpoint (which loads into the other layout). Frozen BN
    and a trained stem, the setting NHWC is chosen for."""
    bn = "model.frozen_bn=true", "model.freeze_stem=false"
    torch.manual_seed(3)
    nchw, criterion, _ = tiny(*bn, "model.channels_last=false")
    torch.manual_seed(3)
    nhwc, _, _ = tiny(*bn, "model.channels_last=true")
    convs = [m.weight for m in nhwc.backbone.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert all(m.weight.is_contiguous() for m in nchw.backbone.modules()
               if isinstance(m, torch.nn.Conv2d))

    imgs = images()
    grads, outs = [], []
    for model in (nchw, nhwc):
        model.train()
        torch.manual_seed(4)  # the same dropout masks
        out = model(imgs)
        loss = sum(criterion(out, targets()).values())
        loss.backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert_close(outs[1]["pred_logits"], outs[0]["pred_logits"], atol=1e-4, rtol=1e-4)
    assert_close(outs[1]["pred_boxes"], outs[0]["pred_boxes"], atol=1e-4, rtol=1e-4)
    assert grads[0].keys() == grads[1].keys() and "backbone.0.body.conv1.weight" in grads[0]
    for name, ref in grads[0].items():  # the layouts sum in other orders
        assert_close_to_scale(grads[1][name], ref, what=name)

    path = tmp_path / "nhwc.pth"
    torch.save({"model": nhwc.state_dict()}, path)
    torch.manual_seed(5)
    fresh, _, _ = tiny(*bn, "model.channels_last=false")
    load_weights(fresh, path)
    for key, value in nhwc.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
