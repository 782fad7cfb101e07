"""The resize rule (detr_irpe/resize.py): its answers for every shipped config, the pairing
of a family with the other augmentation, and a family of one's own whose rule every tool
path asks (test sizes, the config's evaluation size, canvases, the memory estimate)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import load_tiny_config
from torchvision import tv_tensors

from detr_irpe import sizes
from detr_irpe.ablation.results import config_size_label
from detr_irpe.canvas_layouts import parse_canvas
from detr_irpe.config import CONFIG_DIR, Config, estimates, load_config
from detr_irpe.config.estimates import check_sizes
from detr_irpe.data import build_dataset
from detr_irpe.data.canvas_dataset import CanvasDataset
from detr_irpe.data.loader import batch_scales_of
from detr_irpe.data.report import input_resizes
from detr_irpe.data.transforms import (
    build_transforms,
    eval_image,
    eval_size_transforms,
    resized_hw,
)
from detr_irpe.errors import ConfigError
from detr_irpe.family import get_family, register_family
from detr_irpe.inference.runtime import trace_size_for
from detr_irpe.models.detr.config import DETRModelConfig
from detr_irpe.resize import Resize, ResizeRule, ShorterSideRule, SquareRule, resize_rule
from detr_irpe.sizes import parse_eval_size

SHIPPED = sorted(p.stem for p in Path(CONFIG_DIR).glob("*.yaml"))


def _image(height: int = 30, width: int = 50) -> tuple[tv_tensors.Image, dict[str, Any]]:
    image = tv_tensors.Image(torch.randint(0, 256, (3, height, width), dtype=torch.uint8))
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[2.0, 3.0, 20.0, 25.0]]), format="XYXY",
                                     canvas_size=(height, width))
    return image, {"boxes": boxes, "labels": torch.tensor([1]), "area": torch.tensor([396.0]),
                   "iscrowd": torch.tensor([0])}


# ------------------------------------------------------------------------ shipped configs
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_keeps_its_sizes(name: str) -> None:
    """What the rule answers is what the configs meant before it (the augmentation's
    rule: RT-DETR's squares for ``rtdetr``, DETR's shorter side otherwise), read here
    from the data keys as the docs state them."""
    cfg = load_config(name)
    data, rule = cfg.data, resize_rule(cfg)
    assert resize_rule(cfg.data) == rule  # the data section alone finds the same rule
    s640, wide = parse_eval_size("640"), parse_eval_size("480x960")
    assert rule.fixed_shape(wide) == (480, 960)
    if data.augmentation == "rtdetr":
        assert isinstance(rule, SquareRule) and rule.stride == 32
        assert (rule.eval_side, rule.eval_key) == (data.eval_size, "data.eval_size")
        assert rule.eval_shape == (data.eval_size, data.eval_size)
        assert rule.fixed_shape(s640) == (640, 640)
        assert rule.eval_resize() == Resize(square=data.eval_size)
        assert rule.eval_resize(s640) == Resize(shape=(640, 640))
        sides = [data.train_size, data.eval_size, *data.batch_scales]
        assert [(s, s) for s in sides] == [(a, b) for _, a, b in rule.input_sides()]
        stop = data.batch_scales_stop_epoch
        assert batch_scales_of(data, 0) == (list(data.batch_scales) if stop != 0 else [])
        assert trace_size_for(cfg) == (data.eval_size, data.eval_size)
    else:
        assert isinstance(rule, ShorterSideRule) and rule.stride == 1
        assert (rule.eval_side, rule.eval_key) == (data.val_size, "data.val_size")
        assert rule.eval_shape is None and rule.fixed_shape(s640) is None
        assert rule.eval_resize() == Resize(short=data.val_size, cap=data.max_size)
        assert rule.eval_resize(s640) == Resize(
            short=640, cap=max(640, round(data.max_size * 640 / data.val_size)))
        shorts = [*data.train_scales, data.val_size]
        assert [(s, max(s, data.max_size)) for s in shorts] == [
            (a, b) for _, a, b in rule.input_sides()]
        assert batch_scales_of(data, 0) == []
        assert trace_size_for(cfg) is None
    assert config_size_label(cfg) == str(rule.eval_side)


@pytest.mark.parametrize(("name", "augmentation", "kind"), [
    ("synthetic_tiny", "rtdetr", SquareRule),  # DETR family, RT-DETR's recipe
    ("rtdetr_tiny", "simple", ShorterSideRule),  # RT-DETR family, DETR's recipe
])
def test_a_family_paired_with_the_other_augmentation_keeps_its_meaning(
        name: str, augmentation: str, kind: type) -> None:
    """The family's rule does not take the recipe: the recipe's own rule, as before."""
    cfg = load_config(name, [f"data.augmentation={augmentation}"])
    assert type(resize_rule(cfg)) is kind
    assert type(resize_rule(cfg.data)) is kind
    image, target = _image()
    out, _ = build_transforms(cfg.data, "val")(image, target)
    if kind is SquareRule:
        assert tuple(out.shape[-2:]) == (cfg.data.eval_size,) * 2
    else:
        assert tuple(out.shape[-2:]) == resized_hw(30, 50, cfg.data.val_size, cfg.data.max_size)


def test_a_bare_data_section_takes_its_recipes_rule() -> None:
    data = dataclasses.replace(load_config("rtdetr_tiny").data)  # no family noted
    assert not hasattr(data, "family")
    assert isinstance(resize_rule(data), SquareRule)


# ------------------------------------------------------------------ a family of one's own
@dataclass(frozen=True)
class WideRule(ResizeRule):
    """A rule of one's own: every evaluation input is a 1:2 landscape of height ``S``."""

    name: ClassVar[str] = "shorter"
    augmentations: ClassVar[tuple[str, ...]] = ("detr", "simple")
    stride: ClassVar[int] = 16

    train_scales: tuple[int, ...]
    val_size: int

    @classmethod
    def from_data(cls, data: Any) -> WideRule:
        return cls(tuple(data.train_scales), int(data.val_size))

    @property
    def eval_key(self) -> str:
        return "data.val_size"

    @property
    def eval_side(self) -> int:
        return self.val_size

    @property
    def eval_shape(self) -> tuple[int, int]:
        return self.val_size, 2 * self.val_size

    def fixed_shape(self, size):
        return size.shape if size.shape is not None else (size.short, 2 * size.short)

    def image_input(self, size=None):
        return {"size": size or self.val_size, "square": None}

    def input_sides(self):
        return [("data.train_scales", s, 2 * s) for s in self.train_scales] + [
            ("data.val_size", self.val_size, 2 * self.val_size)]

    def describe_training(self) -> str:
        return "wide"

    def report_sizes(self):
        return tuple(sorted(set(self.train_scales))), (self.val_size,), 2 * self.val_size

    def memory_estimate(self):
        return ({"data.val_size": self.val_size}, {"data.val_size": 800},
                lambda v, batch: (v["data.val_size"], 2 * v["data.val_size"]),
                "a batch of wide landscapes")

    def eval_resize(self, size=None):
        return Resize(shape=self.eval_shape if size is None else self.fixed_shape(size))


@dataclass
class WideModelConfig(DETRModelConfig):
    FAMILY: ClassVar[str] = "wide_rule_test"

    family: str = "wide_rule_test"


@pytest.fixture(scope="module")
def wide_family():
    detr = get_family("detr")
    return register_family(dataclasses.replace(
        detr, name="wide_rule_test", title="Wide", model_config=WideModelConfig,
        model_types=(), checkpoint=None, hf=None, benchmark_targets={}, aliases=(),
        resize_rule=WideRule.from_data))


def _wide_config(tiny_dataset: Path, *overrides: str) -> Config:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "data.val_size=32", *overrides)
    keys = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)
            if f.init and f.name != "family"}
    return Config(model=WideModelConfig(**keys), data=cfg.data, train=cfg.train)


def test_a_family_of_ones_own_gets_its_rule_through_every_tool(
        wide_family, tiny_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _wide_config(tiny_dataset)
    assert isinstance(resize_rule(cfg), WideRule)
    assert isinstance(resize_rule(cfg.data), WideRule)  # through the Config's note
    image, target = _image()
    # the config's own evaluation size: val transforms, one image, the run's label
    out, _ = build_transforms(cfg.data, "val")(image, target)
    assert tuple(out.shape[-2:]) == (32, 64)
    assert tuple(eval_image(image, cfg.data).shape[-2:]) == (32, 64)
    assert config_size_label(cfg) == "32" and trace_size_for(cfg) == (32, 64)
    # a test size of --sizes
    out, _ = eval_size_transforms(cfg.data, parse_eval_size("48"))(image, target)
    assert tuple(out.shape[-2:]) == (48, 96)
    # canvases: each image at the rule's evaluation size, then placed
    canvases = CanvasDataset(build_dataset(cfg.data, "val"), parse_canvas("mosaic1x2"))
    canvas, _ = canvases[0]
    assert tuple(canvas.shape[-2:]) == (32, 128)
    # the data report and the memory estimate
    train, evaluation = input_resizes(cfg)
    assert evaluation.sizes == (32,) and evaluation.max_size == 64
    monkeypatch.setattr(estimates, "_check_parameters", lambda m: None)
    monkeypatch.setattr(sizes, "memory_limit", lambda: (1, "a 1-byte machine"))
    with pytest.raises(ConfigError, match="a batch of wide landscapes"):
        check_sizes(cfg)
