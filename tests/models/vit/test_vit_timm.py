"""The ViT trunk against timm's ``VisionTransformer`` (the reference): timm's state dict,
loaded into the trunk, gives timm's outputs and gradients in float64, at the grid the
absolute embedding is stored for and at other grids (timm resamples it with
``dynamic_img_size=True``), through files (.safetensors, .pth, DeiT's ``{"model": ...}``);
files the trunk cannot hold fail with one clear error."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.errors import CheckpointError
from detr_irpe.models.vit import (
    VisionTransformer,
    load_timm_weights,
    resample_abs_pos_embed,
    timm_to_trunk,
)

timm = pytest.importorskip("timm", reason="the timm extra")
from timm.layers import resample_abs_pos_embed as timm_resample  # noqa: E402
from timm.models.vision_transformer import VisionTransformer as TimmViT  # noqa: E402


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random (LayerNorm weights / biases, class token, embedding
    included), so that a wrongly mapped or unused one shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * 0.2
            norm_weight = "norm" in name and name.endswith("weight")
            param.copy_(noise + 1.0 if norm_weight else noise)
    return model.double().eval()


def _small_timm(**kwargs) -> TimmViT:
    """A small timm ViT: 32 px images, 8 px patches (a 4 x 4 grid), 2 blocks of width 32."""
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                dynamic_img_size=True)
    return _randomised(TimmViT(**{**args, **kwargs}))


def _trunk_for(timm_model: TimmViT, **kwargs) -> VisionTransformer:
    embed = timm_model.patch_embed
    args = dict(embed_dim=timm_model.embed_dim, depth=len(timm_model.blocks),
                num_heads=timm_model.blocks[0].attn.num_heads, patch_size=embed.patch_size[0],
                img_size=embed.img_size[0], class_token=timm_model.cls_token is not None)
    trunk = VisionTransformer(**{**args, **kwargs}).double().eval()
    trunk.load_state_dict(timm_to_trunk(timm_model.state_dict(), trunk), strict=True)
    return trunk


@pytest.mark.parametrize("size", [(224, 224), (160, 288)])
def test_timm_vit_tiny_and_the_trunk_agree(size) -> None:
    """vit_tiny_patch16_224 (random weights): tokens after the final norm and the
    intermediates the adapter taps, at the stored 14 x 14 grid (exact) and at 10 x 18 (the
    embedding resampled by both; timm resamples in float32, hence the tolerance there)."""
    reference = _randomised(timm.create_model("vit_tiny_patch16_224", pretrained=False,
                                              dynamic_img_size=True, num_classes=0))
    trunk = _trunk_for(reference)
    images = torch.randn(2, 3, *size, dtype=torch.float64)
    tol = {} if size == (224, 224) else {"rtol": 1e-5, "atol": 1e-5}
    with torch.no_grad():
        if not tol:
            assert torch.equal(trunk(images), reference.forward_features(images))
        torch.testing.assert_close(trunk(images), reference.forward_features(images),
                                   **(tol or {"rtol": 0, "atol": 0}))
        taps = reference.forward_intermediates(images, indices=[3, 7, 11], norm=True,
                                               intermediates_only=True)
        for ours, theirs in zip(trunk.forward_intermediates(images, [3, 7, 11]), taps):
            torch.testing.assert_close(ours, theirs, **(tol or {"rtol": 0, "atol": 0}))


@pytest.mark.parametrize("kwargs", [
    {},
    {"class_token": False, "global_pool": "avg", "fc_norm": False, "init_values": 0.1},
    {"qkv_bias": False},  # loaded as a zero in_proj_bias
])
@pytest.mark.parametrize("size", [(32, 32), (24, 48)])
def test_small_timm_vits_agree_forward_and_backward(kwargs, size) -> None:
    reference = _small_timm(**kwargs)
    trunk = _trunk_for(reference, layer_scale=kwargs.get("init_values"),
                       class_token=kwargs.get("class_token", True))
    images = torch.randn(2, 3, *size, dtype=torch.float64)
    ours, theirs = trunk(images), reference.forward_features(images)
    # at another grid than the stored 4 x 4, timm resamples the embedding in float32
    tol = {"rtol": 1e-12, "atol": 1e-12} if size == (32, 32) else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(ours, theirs, **tol)
    weight = torch.randn_like(ours)
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()
    grads = dict(reference.named_parameters())
    names = {"attn.in_proj_weight": "attn.qkv.weight", "attn.in_proj_bias": "attn.qkv.bias",
             "attn.out_proj.": "attn.proj."}
    compared = 0
    for name, param in trunk.named_parameters():
        theirs_name = name
        for new, old in names.items():
            theirs_name = theirs_name.replace(new, old)
        if theirs_name not in grads:  # the zero in_proj_bias of a qkv_bias=False model
            assert kwargs.get("qkv_bias") is False and "in_proj_bias" in name
            continue
        torch.testing.assert_close(param.grad, grads[theirs_name].grad, **tol)
        compared += 1
    assert compared >= 2 + 2 * 10  # patch conv, norms, every block's weights


def test_resampling_is_timms_bit_for_bit() -> None:
    """The published interpolation: bicubic, antialiased, class entry kept; float32 as
    timm computes it."""
    pos = torch.randn(1, 1 + 7 * 7, 16)
    for new in [(7, 7), (10, 4), (3, 5), (14, 14)]:
        ours = resample_abs_pos_embed(pos, new, (7, 7), 1)
        theirs = timm_resample(pos, list(new), old_size=[7, 7], num_prefix_tokens=1)
        assert torch.equal(ours, theirs), new
        assert torch.equal(ours[:, :1], pos[:, :1])


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", "deit.pth"])
def test_a_timm_file_loads_by_path(tmp_path, suffix) -> None:
    reference = _small_timm()
    state = {k: v.float() for k, v in reference.state_dict().items()}
    path = tmp_path / f"vit{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:  # DeiT's releases wrap the state dict: {"model": ...}
        torch.save({"model": state} if suffix == "deit.pth" else state, path)
    trunk = VisionTransformer(32, 2, 2, 8, 32)
    load_timm_weights(trunk, path)
    images = torch.randn(1, 3, 32, 40)
    with torch.no_grad():
        torch.testing.assert_close(trunk(images), reference.float().forward_features(images))


def test_a_file_for_another_grid_is_resampled_on_load(tmp_path) -> None:
    """A file stored for a 7 x 7 grid into a trunk stored for 4 x 4: its embedding is the
    file's, resampled as timm resamples it (in float32, hence the tolerance)."""
    reference = _small_timm(img_size=56)  # 7 x 7 grid
    trunk = VisionTransformer(32, 2, 2, 8, 32).double()  # 4 x 4 grid
    trunk.load_state_dict(timm_to_trunk(reference.state_dict(), trunk), strict=True)
    expected = timm_resample(reference.pos_embed.detach(), [4, 4], old_size=[7, 7])
    torch.testing.assert_close(trunk.pos_embed.detach(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s.update(dist_token=torch.zeros(1, 1, 32)), "distillation token"),
    (lambda s: s.update({"blocks.0.attn.q_norm.weight": torch.ones(16)}), "qk_norm"),
    (lambda s: s.pop("blocks.1.mlp.fc2.weight"), r"lacks trunk weights blocks\.1\.mlp\.fc2"),
    (lambda s: s.update({"patch_embed.proj.weight": torch.zeros(32, 3, 16, 16)}),
     r"does not fit the ViT trunk .*patch_embed\.proj\.weight \(32, 3, 16, 16\)"),
    (lambda s: s.update(extra=torch.zeros(1)), "keys the ViT trunk does not have: extra"),
])
def test_files_that_do_not_fit_fail_clearly(tmp_path, change, message) -> None:
    state = _small_timm().state_dict()
    change(state)
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=message):
        load_timm_weights(VisionTransformer(32, 2, 2, 8, 32), path)


def test_unreadable_files_fail_clearly(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="file not found"):
        load_timm_weights(VisionTransformer(32, 2, 2, 8, 32), tmp_path / "none.pth")
    path = tmp_path / "list.pth"
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="no state dict"):
        load_timm_weights(VisionTransformer(32, 2, 2, 8, 32), path)
