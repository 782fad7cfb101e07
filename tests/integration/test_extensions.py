"""Extension points (issue 23, item 1): a backbone registry (torchvision ResNets, timm
models, a user's own), registered bucket methods, and ``model.import``, which runs a
user's registrations before the config is checked, in every tool and torchrun worker."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import AXIS_STEPS, CHEBYSHEV, ROOT, load_tiny_config
from irpe_reference import ref_attention, ref_bucket_ids

from detr_irpe.attention import MultiheadAttention
from detr_irpe.config import config_from_dict
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.irpe import RPEConfig
from detr_irpe.models import backbone_registry as registry
from detr_irpe.models import build_model, model_from_checkpoint
from detr_irpe.structures import ImageBatch

# A user's module: a small CNN backbone and the Chebyshev-distance bucket method
# (bucket = max(|dr|, |dc|), capped at 2 * ratio). Every test writes it under a name of
# its own: a module is imported once per process.
PLUGIN = '''
import torch
from torch import nn

from detr_irpe.irpe import register_bucket_method
from detr_irpe.models.backbone_registry import BackboneBody, register_backbone


@register_backbone("{backbone}")
def tiny_cnn(*, weights, frozen_bn, dilation, stages):
    if weights not in (None, "none"):
        raise ValueError("tiny_cnn has no pretrained weights")
    body = nn.Sequential()
    body.add_module("stem", nn.Conv2d(3, 8, 3, stride=4, padding=1))
    body.add_module("act", nn.ReLU())
    body.add_module("stage", nn.Conv2d(8, 16, 3, stride=4, padding=1))
    return BackboneBody(body=body, num_channels=16, stride=16, stem=("stem",))


def chebyshev(dr, dc, ratio):
    return torch.maximum(dr.abs(), dc.abs()).clamp(max=int(2 * ratio)).long()


register_bucket_method("{method}", chebyshev, num_buckets=lambda ratio: int(2 * ratio) + 1)
'''


def write_plugin(folder: Path, name: str) -> list[str]:
    """Write the plugin as ``folder/name.py``; the overrides that use it."""
    (folder / f"{name}.py").write_text(PLUGIN.format(backbone=f"{name}_cnn",
                                                     method=f"{name}_cheb"))
    return [f"model.import={name}", f"model.backbone={name}_cnn",
            f"model.rpe=rpe-2.0-{name}_cheb-ctx-1-qk"]


def _batch(size: int = 64) -> ImageBatch:
    return ImageBatch(torch.randn(2, 3, size, size), torch.zeros(2, size, size, dtype=torch.bool))


# ----------------------------------------------------------------------------- model.import
def test_model_import_registers_a_users_backbone_and_bucket_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dataset: Path,
) -> None:
    monkeypatch.chdir(tmp_path)  # found in the working directory, as python -m would
    overrides = write_plugin(tmp_path, "plugin_cwd")
    with pytest.raises(ConfigError, match="plugin_cwd_cnn' is not a registered backbone"):
        load_tiny_config(*overrides[1:])  # without the import: refused, named
    cfg = load_tiny_config(f"data.root={tiny_dataset}", *overrides)
    assert cfg.model.imports == ["plugin_cwd"]
    assert "plugin_cwd" in sys.modules and str(tmp_path) not in sys.path
    cfg.model.num_classes = 3
    model, _, _ = build_model(cfg)
    backbone = model.backbone[0]
    assert backbone.num_channels == 16 and backbone.stride == 16
    assert model.input_proj.in_channels == 16
    # freeze_stem fixes the builder's stem prefixes only
    cfg.model.freeze_stem = True
    frozen = {n: p.requires_grad for n, p in build_model(cfg)[0].backbone[0].body.named_parameters()}
    assert frozen == {"stem.weight": False, "stem.bias": False,
                      "stage.weight": True, "stage.bias": True}
    irpe = model.transformer.encoder.layers[0].self_attn.entry("irpe")
    assert irpe.rpe.method.name == "plugin_cwd_cheb"
    assert irpe.rpe_k.lookup_table_weight.shape[-1] == 5  # 2 * 2.0 + 1 buckets
    out = model(_batch())
    assert out["pred_logits"].shape == (2, 4, 4) and torch.isfinite(out["pred_boxes"]).all()


def test_model_import_is_saved_with_the_config_and_takes_a_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = write_plugin(tmp_path, "plugin_list")
    cfg = load_tiny_config("model.import=[plugin_list]", *overrides[1:])
    text = cfg.to_yaml()
    assert "import:\n  - plugin_list\n" in text and "imports" not in text
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
    for nothing in ("null", "none", "''", "[]"):
        assert load_tiny_config(f"model.import={nothing}").model.imports == []


@pytest.mark.parametrize("body, message", [
    ("raise RuntimeError('no GPU kernels here')",
     r"model\.import: importing 'broken_[a-z]+' failed at .*broken_[a-z]+\.py:1: "
     r"RuntimeError: no GPU kernels here"),
    ("import not_installed_dependency_xyz",
     r"broken_[a-z]+' failed at .*: ModuleNotFoundError: No module named "
     r"'not_installed_dependency_xyz'"),
])
def test_a_failing_user_module_is_one_line_naming_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, message: str,
) -> None:
    name = f"broken_{'runtime' if 'raise' in body else 'dependency'}"
    (tmp_path / f"{name}.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=message) as info:
        load_tiny_config(f"model.import={name}")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"no module named 'no_such_plugin_xyz'"):
        load_tiny_config("model.import=no_such_plugin_xyz")


def _docs_plugin_and_command() -> tuple[str, list[str]]:
    """The ``my_plugin.py`` of docs/model.md and its first documented command."""
    text = (ROOT / "docs/model.md").read_text()
    start = text.index("```python\n# my_plugin.py") + len("```python\n")
    code = text[start:text.index("```", start)]
    start = text.index("```bash\n", start) + len("```bash\n")
    block = text[start:text.index("```", start)]
    command = block.split("\n#", 1)[0].replace("\\\n", " ")
    return code, shlex.split(command)


@pytest.mark.slow  # a training subprocess (~6 s); in-process registration is tested above
def test_docs_plugin_in_a_tool_and_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dataset: Path,
) -> None:
    """docs/model.md's example verbatim: tools/train.py in a fresh process imports the
    plugin from the working directory; the checkpoint's saved config names it, and it is
    imported again where the model is rebuilt (here, in this process) once trusted."""
    code, command = _docs_plugin_and_command()
    (tmp_path / "my_plugin.py").write_text(code)
    assert command[:2] == ["python", "tools/train.py"] and "model.import=my_plugin" in command
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / command[1]), *command[2:], "--device", "cpu",
         "--output-dir", str(out), "--no-progress", "--set", f"data.root={tiny_dataset}",
         "train.epochs=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.import=my_plugin.*--trust-imports"):
        model_from_checkpoint(out / "checkpoint_last.pth")
    loaded = model_from_checkpoint(out / "checkpoint_last.pth", trust_imports=True)
    assert loaded.cfg.model.imports == ["my_plugin"]
    assert loaded.model.backbone[0].num_channels == 64
    assert loaded.model.transformer.encoder.layers[0].self_attn.entry("irpe").rpe.method.name == "chebyshev"
    assert loaded.model(_batch())["pred_logits"].shape[:2] == (2, 4)


@pytest.mark.slow
def test_every_torchrun_worker_imports_the_plugin(tmp_path: Path, tiny_dataset: Path) -> None:
    overrides = write_plugin(tmp_path, "plugin_torchrun")
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tools/train.py"), "--config", "synthetic_tiny", "--device", "cpu",
         "--output-dir", str(out), "--no-progress", "--set", f"data.root={tiny_dataset}",
         "train.epochs=1", "train.batch_size=2", *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "checkpoint_last.pth").is_file()


# ----------------------------------------------------------------------------- bucket methods
def test_rpe_string_of_a_registered_method_round_trips() -> None:
    cfg = RPEConfig.from_string(f"rpe-2.5-{CHEBYSHEV}-bias-0-qk")
    assert cfg.method.name == CHEBYSHEV and cfg.to_string() == f"rpe-2.5-{CHEBYSHEV}-bias-0-qk"
    assert RPEConfig.from_string(cfg.to_string()) == cfg
    with pytest.raises(ValueError, match=rf"unknown iRPE method 'nearest'.*{CHEBYSHEV}"):
        RPEConfig.from_string("rpe-2.0-nearest-ctx-1-k")


@pytest.mark.parametrize("rpe, impl", [
    (f"rpe-1.9-{CHEBYSHEV}-ctx-0-qkv", "explicit"),
    (f"rpe-1.9-{CHEBYSHEV}-ctx-1-qkv", "blocked"),
    (f"rpe-2.5-{CHEBYSHEV}-bias-0-qk", "blocked"),
    (f"rpe-2.5-{CHEBYSHEV}-bias-1-k", "sdpa"),
    # a registered method with two tables (rows and columns, as cross)
    (f"rpe-1.9-{AXIS_STEPS}-ctx-0-qkv", "explicit"),
    (f"rpe-2.0-{AXIS_STEPS}-ctx-1-qkv", "blocked"),
    (f"rpe-2.5-{AXIS_STEPS}-bias-0-qk", "sdpa"),
])
def test_attention_with_a_registered_method_matches_the_dense_reference(
    rpe: str, impl: str,
) -> None:
    """Forward and gradients (float64) against the python-loop ids and dense attention."""
    module = MultiheadAttention(16, 2, encodings=[IRPEEncoding(rpe, 8, 2)], impl=impl).double().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lookup_table" in name:
                p.normal_(0.0, 0.5)
    cfg, hw = module.encodings["irpe"].rpe, (3, 4)
    method = cfg.method.name
    if method == AXIS_STEPS:  # the state-dict keys of a two-table method are cross's
        assert {k.split(".")[3] for k in module.state_dict() if "lookup_table" in k} == {
            "rp_rows", "rp_cols"}
    ids = torch.tensor(ref_bucket_ids(method, *hw, cfg.ratio)[0])
    query = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    value = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    # the reference reads the tables by their names in the attention (``rpe_k...``)
    params = {k.removeprefix("encodings.irpe."): v.detach().clone().requires_grad_(True)
              for k, v in module.state_dict().items()}
    ref_out, _ = ref_attention(params, 2, cfg.rpe_on, method, ids, query, query, value)
    out, _ = module(query, query, value, hw, need_weights=False)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-7)
    grad = torch.randn_like(out)
    got = torch.autograd.grad((out * grad).sum(), [query, value, *module.parameters()])
    want = torch.autograd.grad((ref_out * grad).sum(), [query, value, *params.values()],
                               allow_unused=True)
    want_by_name = dict(zip(["query", "value", *params], want))
    names = ["query", "value", *(n.removeprefix("encodings.irpe.")
                                 for n, _ in module.named_parameters())]
    for name, g in zip(names, got):
        torch.testing.assert_close(g, want_by_name[name], atol=1e-10, rtol=1e-7, msg=name)


# ----------------------------------------------------------------------------- backbones
def test_torchvision_resnets_are_registered_by_default() -> None:
    assert set(registry.TORCHVISION_RESNETS) <= set(registry.backbone_names())
    cfg = load_tiny_config("model.num_classes=3")
    assert type(build_model(cfg)[0].backbone[0].body).__name__ == "Sequential"


def test_register_backbone_refuses_clashes() -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backbone("resnet50", lambda **kwargs: None)
    with pytest.raises(ValueError, match="timm models"):
        registry.register_backbone("timm:mine", lambda **kwargs: None)


TIMM_MODEL = "test_convnext"  # timm's 0.2 M-parameter test network: builds in milliseconds


@pytest.fixture
def timm():
    """The timm package (the ``timm`` extra; CI installs it with the ``test`` extra)."""
    return pytest.importorskip("timm")


@pytest.mark.parametrize("stages, channels, stride", [(4, 64, 32), (3, 48, 16), (2, 32, 8)])
def test_timm_backbone_reads_channels_and_stride_from_the_model(
    timm, stages: int, channels: int, stride: int,
) -> None:
    cfg = load_tiny_config(f"model.backbone=timm:{TIMM_MODEL}", "model.num_classes=3",
                           f"model.backbone_stages={stages}", "model.freeze_stem=true")
    model, _, _ = build_model(cfg)
    backbone = model.backbone[0]
    reference = timm.create_model(TIMM_MODEL, features_only=True, pretrained=False,
                                  out_indices=(stages - 5,))
    info = reference.feature_info
    assert (backbone.num_channels, backbone.stride) == (channels, stride)
    assert (info.channels()[-1], info.reduction()[-1]) == (channels, stride)
    # the same weights give the same features as timm's own model
    reference.load_state_dict(backbone.body.features.state_dict())
    images = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(backbone(images, torch.zeros(2, 64, 64, dtype=torch.bool))[0],
                               reference(images)[-1])
    # freeze_stem: the stem and the stride-4 stage stay fixed, the rest trains
    trainable = {n.split(".")[1] for n, p in backbone.body.named_parameters() if p.requires_grad}
    frozen = {n.split(".")[1] for n, p in backbone.body.named_parameters()
              if not p.requires_grad}
    assert frozen == {"stem_0", "stem_1", "stages_0"} and "stages_0" not in trainable
    out = model(_batch())
    assert out["pred_boxes"].shape == (2, 4, 4)


def test_timm_backbone_never_downloads_unless_asked(
    timm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import timm.models._builder as builder

    def no_download(*args, **kwargs):
        raise AssertionError("pretrained weights were fetched without being asked for")

    monkeypatch.setattr(builder, "load_pretrained", no_download)
    cfg = load_tiny_config(f"model.backbone=timm:{TIMM_MODEL}", "model.num_classes=3")
    model, _, _ = build_model(cfg)  # backbone_weights=none
    path = tmp_path / "ckpt.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, path)
    loaded = model_from_checkpoint(path)  # weights from the file, none from timm
    torch.testing.assert_close(loaded.model.state_dict(), model.state_dict())


def test_timm_pretrained_weights_offline_without_cache_is_one_clear_line(
    timm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    cfg = load_tiny_config("model.backbone=timm:resnet18", "model.backbone_weights=imagenet",
                           "model.num_classes=3")
    with pytest.raises(CheckpointError) as info:
        build_model(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert "timm:resnet18" in message and "HF_HUB_OFFLINE" in message, message


def test_timm_local_weights_are_loaded(timm, tmp_path: Path) -> None:
    source = timm.create_model(TIMM_MODEL, pretrained=False)
    path = tmp_path / "convnext_weights.pth"
    torch.save(source.state_dict(), path)
    cfg = load_tiny_config(f"model.backbone=timm:{TIMM_MODEL}", f"model.backbone_weights={path}",
                           "model.num_classes=3")
    features = build_model(cfg)[0].backbone[0].body.features
    torch.testing.assert_close(features.stem_0.weight, source.stem[0].weight)
    torch.testing.assert_close(features.stages_1.downsample[1].weight,
                               source.stages[1].downsample[1].weight)
    torch.save({"not": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="is not a timm test_convnext state dict"):
        build_model(cfg)


def test_timm_errors_name_the_model_and_the_extra(
    timm, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = load_tiny_config("model.backbone=timm:no_such_net_xyz", "model.num_classes=3")
    with pytest.raises(ConfigError, match=r"timm:no_such_net_xyz: timm .* has no model"):
        build_model(cfg)
    with pytest.raises(ConfigError, match="names no timm model"):
        load_tiny_config("model.backbone='timm:'")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "timm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"detr_irpe\[timm\]"):
        load_tiny_config(f"model.backbone=timm:{TIMM_MODEL}")
    monkeypatch.setitem(sys.modules, "timm", None)  # what an absent package looks like
    from detr_irpe.models.timm_backbone import timm_body

    with pytest.raises(ConfigError, match=r"pip install 'detr_irpe\[timm\]'"):
        timm_body(TIMM_MODEL, weights=None, frozen_bn=True, dilation=False, stages=4)

