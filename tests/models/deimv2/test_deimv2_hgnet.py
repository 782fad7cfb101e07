"""DEIMv2's HGNetv2 sizes (Atto, Femto, Pico: three-stage HGNetv2 + lite encoder; N: B0 +
hybrid encoder) against the published code (github.com/Intellindust-AI-Lab/DEIMv2 at
0fff8d4; ``tests/reference_data/deimv2/make_deimv2_hgnet_official.py`` ran it on the CPU).

The data hold what the published detectors computed in float64 from deterministic weights
(``deimv2_hgnet_weights.hgnet_state_dict``, a function of each key) on two seeded images
at each size's published eval size (Atto 320, Femto 416, Pico and N 640; 5 classes, 30
queries, 20 denoising queries): the eval outputs, the published post-processor's
detections, and for Atto and N a training forward with seeded denoising. The weights reach
the model through the project's loader from a file in the published solver's layout. The
comparisons allow what float64 sums in another order can differ by plus the RMS norms'
float32 rounding on another CPU (test_deimv2_official.py's bound). The state-dict keys,
shapes and parameter counts of the published configs (80 classes) are the published
models'; a published file without a config is recognised as DEIMv2 of its size (its keys
are D-FINE's too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deimv2_hgnet_weights import hgnet_state_dict
from official_numerics import assert_training_forward_equal, reference_float32, training_targets
from test_deimv2_official import _tolerance, assert_eval_equal

from detr_irpe.checkpoint.load import load_weights
from detr_irpe.family import family_of_state
from detr_irpe.models.deimv2.build import build_deimv2
from detr_irpe.models.deimv2.checkpoint import CHECKPOINT, published_size
from detr_irpe.models.deimv2.config import DEIMv2ModelConfig
from detr_irpe.models.deimv2.encoder_blocks import LiteEncoder
from detr_irpe.models.hgnetv2 import HGNetv2
from detr_irpe.models.hybrid.decoder import generate_anchors

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
F64 = torch.float64
SIZES = ("atto", "femto", "pico", "n")


def _load(size: str) -> dict:
    return torch.load(DATA / f"deimv2_hgnet_official_{size}.pt", weights_only=True)


def _config(size: str, **overrides) -> DEIMv2ModelConfig:
    # the data's images are the network's input as they are ([0, 1] pixels, as published)
    return DEIMv2ModelConfig.for_size(size, num_classes=5, num_queries=30, num_denoising=20,
                                      input_normalization="none", **overrides)


def _images(shape) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0), dtype=F64)


def _published_file(model: torch.nn.Module, path: Path, side: int, strides) -> Path:
    """The model's deterministic weights as the published solver saves them (``model`` and
    ``ema.module``, the anchors and valid mask of the eval size), in float64."""
    state = hgnet_state_dict(model)
    anchors, valid = generate_anchors([(side // s, side // s) for s in strides])
    state["decoder.anchors"], state["decoder.valid_mask"] = anchors.double(), valid
    torch.save({"model": state, "ema": {"module": state, "updates": 1}, "last_epoch": 0}, path)
    return path


def _model(size: str, side: int, tmp_path: Path) -> torch.nn.Module:
    cfg = _config(size)
    model = build_deimv2(cfg).double()
    path = _published_file(model, tmp_path / "best_stg2.pth", side, cfg.detection_strides())
    assert load_weights(model, path) is not None
    return model.eval()


def _check_eval(size: str, tmp_path: Path) -> None:
    ref = _load(size)
    assert_eval_equal(_model(size, ref["image_shape"][-1], tmp_path), ref)


@pytest.mark.parametrize("size", SIZES)
def test_eval_outputs_from_a_published_file_equal_the_published_code(
        size: str, tmp_path: Path) -> None:
    _check_eval(size, tmp_path)


@pytest.mark.parametrize("size", ["atto", "n"])
def test_training_forward_with_denoising_equals_the_published_code(
        size: str, tmp_path: Path) -> None:
    data = _load(size)
    ref = data["train"]
    model = _model(size, data["image_shape"][-1], tmp_path).train()
    torch.manual_seed(ref["seed"])  # the denoising noise: the published code's draws
    with reference_float32("dfine"):
        out = model(_images(data["image_shape"]), training_targets())
    assert_training_forward_equal(out, ref, lambda value: _tolerance(model, value),
                                  skip=lambda key: key.endswith("corners"))


def _published_keys(size: str) -> dict:
    return json.loads((DATA / "deimv2_hgnet_official_keys.json").read_text())[size]


@pytest.mark.parametrize("size", SIZES)
def test_state_dict_keys_shapes_and_parameter_counts_are_the_published_ones(size: str) -> None:
    published = _published_keys(size)
    model = build_deimv2(DEIMv2ModelConfig.for_size(size))
    ours = sorted([k, list(v.shape)] for k, v in model.state_dict().items())
    theirs = sorted(k for k in published["keys"]
                    if k[0] not in ("decoder.anchors", "decoder.valid_mask"))
    assert ours == theirs
    assert sum(p.numel() for p in model.parameters()) == published["parameters"]
    assert isinstance(model.backbone, HGNetv2)
    assert isinstance(model.encoder, LiteEncoder) == (size != "n")


@pytest.mark.parametrize("size", SIZES)
def test_a_published_file_without_config_is_deimv2_of_its_size(size: str) -> None:
    # the published layout (80 classes, anchors), keys and shapes from the published model
    state = {k: torch.zeros(shape) for k, shape in _published_keys(size)["keys"]}
    assert family_of_state(state).name == "deimv2"
    assert published_size(state) == size
    assert CHECKPOINT.implied_config("f.pth", state, {}) == (f"deimv2_{size}", {})


def test_the_hgnetv2_sizes_read_pixels_and_refuse_vit_keys() -> None:
    from detr_irpe.errors import ConfigError
    from detr_irpe.structures import IMAGENET_MEAN

    model = build_deimv2(DEIMv2ModelConfig.for_size("atto"))
    # input_normalization imagenet (the package's data): the model undoes it, as D-FINE's
    assert torch.allclose(model.input_mean.flatten().double(),
                          torch.tensor(IMAGENET_MEAN, dtype=F64), atol=1e-6)
    with pytest.raises(ConfigError, match="model.use_sta"):
        DEIMv2ModelConfig.for_size("atto", use_sta=True)
    with pytest.raises(ConfigError, match="model.backbone_return_idx"):
        DEIMv2ModelConfig.for_size("atto", backbone_return_idx=[2, 3])
    with pytest.raises(ConfigError, match="model.num_points"):
        DEIMv2ModelConfig.for_size("n", num_points=[3, 6, 3])
    with pytest.raises(ConfigError, match="model.encodings.backbone"):
        DEIMv2ModelConfig.for_size("n", encodings={"backbone": ["rope-dinov3"]})
    with pytest.raises(ConfigError, match="model.encoder_type"):
        DEIMv2ModelConfig.for_size("s", encoder_type="lite")


@pytest.mark.parametrize("size", SIZES)
def test_zoo_names_give_their_config_and_the_published_file_loads_without_one(
        size: str, hub_dir: Path) -> None:
    """``deimv2_<size>``: the published file's address and name, its config; a file in
    the published solver's layout (80 classes, anchors of the eval size) placed in
    torch.hub's cache loads by that name into DEIMv2 of the size, and the same file by its
    path alone (no config) too."""
    from detr_irpe.checkpoint import zoo
    from detr_irpe.checkpoint.download import resolve_checkpoint
    from detr_irpe.config import load_config
    from detr_irpe.models import model_from_checkpoint

    name = f"deimv2_{size}"
    entry = zoo.zoo_entry(name)
    assert entry.config == name and entry.family == "deimv2"
    assert entry.url.startswith("https://") and entry.file_name == \
        f"deimv2_hgnetv2_{size}_coco.pth"
    cfg = load_config(name)
    assert cfg.model.size == size and cfg.model.backbone == DEIMv2ModelConfig.for_size(
        size).backbone
    model = build_deimv2(DEIMv2ModelConfig.for_size(size))
    cached = hub_dir / "checkpoints" / entry.file_name
    cached.parent.mkdir(parents=True)
    _published_file(model, cached, cfg.data.eval_size, cfg.model.detection_strides())
    source = resolve_checkpoint(name, progress=False)
    assert (source.path, source.config) == (cached, name)
    for config in (source.config, None):
        loaded = model_from_checkpoint(cached, config)
        assert loaded.cfg.model.family == "deimv2" and loaded.cfg.model.size == size
        state = loaded.model.state_dict()
        for key, value in hgnet_state_dict(model).items():
            torch.testing.assert_close(state[key].double(), value.double(), rtol=0, atol=1e-7,
                                       msg=key)


@pytest.mark.parametrize("size", SIZES)
def test_a_hugging_face_folder_loads_in_transformers_and_reads_back(
        size: str, tmp_path: Path) -> None:
    """``--to hf``: transformers' Deimv2ForObjectDetection (HGNetV2 backbone; the lite
    encoder for Atto-Pico) loads the folder with no missing, unexpected or mismatched key,
    and this package reads it back as the same weights and the same size."""
    transformers = pytest.importorskip("transformers")
    from detr_irpe.checkpoint.hf_folder import write_hf_folder
    from detr_irpe.config import load_config
    from detr_irpe.models import build_model, model_from_checkpoint

    cfg = load_config(f"deimv2_{size}", ["model.num_classes=3"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    out = tmp_path / "hf"
    write_hf_folder(model.state_dict(), cfg, out)
    _, info = transformers.Deimv2ForObjectDetection.from_pretrained(
        out, output_loading_info=True)
    assert not any(info.values()), info
    back = model_from_checkpoint(out)
    assert (back.cfg.model.size, back.cfg.model.backbone) == (size, cfg.model.backbone)
    state = back.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("size", ["atto", "n"])
def test_backbone_and_encoder_compute_transformers_function(size: str, tmp_path: Path) -> None:
    """The folder's HGNetV2 and encoder in transformers give this model's encoder maps in
    float64 (its decoder computes another function: hf_keys' module docstring). Atto's
    lite encoder: to float64's last bits; N's AIFI adds a sine table made in float32 here
    (as published) and in float64 there, which moves the maps by less than 1e-6 of their
    size."""
    transformers = pytest.importorskip("transformers")
    from detr_irpe.checkpoint.hf_folder import write_hf_folder
    from detr_irpe.config import load_config
    from detr_irpe.models import build_model

    cfg = load_config(f"deimv2_{size}", ["model.num_classes=3"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    model.load_state_dict(hgnet_state_dict(model))
    write_hf_folder(model.state_dict(), cfg, tmp_path / "hf")
    theirs = transformers.Deimv2ForObjectDetection.from_pretrained(tmp_path / "hf")
    theirs, model = theirs.double().eval(), model.double().eval()
    x = _images((2, 3, 320, 320))
    with torch.no_grad():
        ours = model.encoder(model.backbone(x))
        maps = theirs.model.encoder(theirs.model.conv_encoder(x)).feature_maps
    assert len(ours) == len(maps) == 2
    for a, b in zip(ours, maps):
        scale = float(a.abs().max())
        torch.testing.assert_close(a, b, rtol=0,
                                   atol=(1e-12 if size == "atto" else 1e-6) * scale)


def test_the_figures_offered_leave_out_the_lite_encoders_attention() -> None:
    # the lite encoder has no attention layer (it raised AttributeError before), N's AIFI has
    from detr_irpe.cli.programs.visualize import available_figures

    atto = build_deimv2(DEIMv2ModelConfig.for_size("atto"))
    n = build_deimv2(DEIMv2ModelConfig.for_size("n"))
    assert "encoder-attention" not in available_figures(atto)
    assert "encoder-attention" in available_figures(n)


@pytest.mark.parametrize("size", ["atto", "n"])
def test_the_shipped_recipe_trains_and_evaluates_through_tools_train(
        size: str, tiny_dataset: Path, tmp_path: Path) -> None:
    """``deimv2_<size>`` (its model, losses, recipe) shrunk to the tiny dataset: images of
    64 / 128 px, few queries, one epoch, through tools/train.py to a COCO evaluation."""
    import json

    from helpers import load_tool

    side = 64 if size == "atto" else 128
    out = tmp_path / "run"
    status = load_tool("train").main([
        "--config", f"deimv2_{size}", "--no-progress", "--set", f"data.root={tiny_dataset}",
        f"train.output_dir={out}", "train.epochs=1", "train.batch_size=2",
        "train.warmup_iters=0", "train.loggers=[]", f"data.train_size={side}",
        f"data.eval_size={side}", "data.aug_policy_epochs=[0,0,0]", "data.mosaic_prob=0.0",
        "data.mixup_prob=0.0", "data.copyblend_prob=0.0", "data.num_workers=0",
        "model.num_queries=10", "model.num_denoising=10", "model.num_select=10",
        "data.batch_scales=[]", "train.amp=none",
        "train.lr_schedule=multistep", "train.lr_milestones=[1000]",
        "data.train_ann=annotations/instances_train.json", "data.train_images=train",
        "data.val_ann=annotations/instances_val.json", "data.val_images=val"])
    assert status == 0
    records = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    assert len(records) == 1 and len(records[-1]["test_coco_eval_bbox"]) == 12
