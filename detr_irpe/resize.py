"""The resize rule: how a family's images become model inputs (docs/data.md, "The resize
rule").

A resize rule is one small frozen object that answers every size question a tool asks of
a config: the training sizes, the evaluation size, the stride its sizes are meant to be a
multiple of, what a test size of ``--sizes`` (``S`` or ``HxW``) and a canvas become, the
sides the memory estimate and the config checks read, and the transforms it builds. Two
rules ship:

- :class:`ShorterSideRule` (DETR, DAB-DETR, DN-DETR): the shorter side of a training image
  is drawn from ``data.train_scales``, of an evaluation image ``data.val_size``; the
  longer side is capped at about ``data.max_size``; any size (the batch is padded under
  a mask).
- :class:`SquareRule` (RT-DETR, D-FINE / DEIM): every image becomes a square, ``data.
  train_size`` (then each batch one of ``data.batch_scales``) in training and
  ``data.eval_size`` in evaluation; the model pads each side to a multiple of 32.

The family registry gives the rule (:attr:`detr_irpe.family.DetectorFamily.resize_rule`:
a function of the ``data`` section); ``data.augmentation`` names only the recipe of
random ops. A rule lists the recipes it takes (:attr:`ResizeRule.augmentations`); a
config that pairs a family with a recipe its rule does not take (a DETR config with
``augmentation: rtdetr``, an RT-DETR one with ``augmentation: detr``) keeps the meaning
it has always had: the rule that recipe was written for (:data:`AUGMENTATION_RULES`).
A ``data`` section on its own (no ``Config`` around it, so no family) also gets that rule.

This module imports no torch (the config checks ask it): a rule says which resize an
evaluation image gets (:class:`Resize`), :mod:`detr_irpe.data.transforms` builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from detr_irpe.family import get_family
from detr_irpe.sizes import EvalSize

__all__ = [
    "AUGMENTATION_RULES",
    "Resize",
    "ResizeRule",
    "ShorterSideRule",
    "SquareRule",
    "resize_rule",
]


def _span(values: list[int] | tuple[int, ...]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


@dataclass(frozen=True)
class Resize:
    """One deterministic resize of an evaluation image; exactly one of three kinds:
    ``short`` (the shorter side, the longer one about ``cap``), ``square`` (``square x
    square``, aspect ratio not kept) or ``shape`` (exactly ``(height, width)``)."""

    short: int | None = None
    cap: int | None = None
    square: int | None = None
    shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if sum(v is not None for v in (self.short, self.square, self.shape)) != 1:
            raise ValueError(f"a resize is one of short / square / shape, got {self}")


@dataclass(frozen=True)
class ResizeRule:
    """What a family's inputs are; the base of the rules (a family's own rule subclasses
    it and answers every method).

    Attributes (class level):
        name: ``"shorter"`` / ``"square"``: how the data report scales an image with the
            rule's sizes (the shorter side capped, or a square).
        augmentations: the ``data.augmentation`` recipes the rule takes.
        stride: the multiple the model pads an input side to (1: any side is fed as it
            is).
    """

    name: ClassVar[str] = ""
    augmentations: ClassVar[tuple[str, ...]] = ()
    stride: ClassVar[int] = 1

    @classmethod
    def from_data(cls, data: Any) -> ResizeRule:
        """The rule with the sizes of a ``data`` section."""
        raise NotImplementedError

    # -- evaluation -----------------------------------------------------------------------
    @property
    def eval_key(self) -> str:
        """The config key of the evaluation size (``"data.val_size"``)."""
        raise NotImplementedError

    @property
    def eval_side(self) -> int:
        """The config's own evaluation size: one number (a shorter side or a square's)."""
        raise NotImplementedError

    @property
    def eval_shape(self) -> tuple[int, int] | None:
        """``(height, width)`` of every evaluation input when it is one shape; None when
        each image keeps its aspect ratio."""
        return None

    def eval_label(self) -> str:
        """The label of the config's own test size (a size table's row): ``"800"``."""
        return str(self.eval_side)

    def fixed_shape(self, size: EvalSize) -> tuple[int, int] | None:
        """``(height, width)`` of every image at test size ``size`` when that is one shape
        (an ``HxW`` size always is); None when each image keeps its aspect ratio."""
        return size.shape

    def largest_input(self, size: EvalSize, batch: int) -> tuple[int, int]:
        """``(height, width)`` of the largest padded batch at test size ``size``."""
        shape = self.fixed_shape(size)
        if shape is None:
            raise NotImplementedError
        return shape

    def model_input(self, height: int, width: int) -> tuple[int, int]:
        """The input the model sees for an image of ``height`` x ``width``: each side
        rounded up to a multiple of :attr:`stride`."""
        s = self.stride
        return -(-height // s) * s, -(-width // s) * s

    def image_input(self, size: int | None = None) -> dict[str, Any]:
        """The keyword arguments of :func:`detr_irpe.data.inputs.prepare_image` for one
        image at evaluation (``size``: a shorter side asked for instead, ``--size``)."""
        raise NotImplementedError

    # -- training -------------------------------------------------------------------------
    def train_sides(self) -> list[tuple[str, int, int]]:
        """``(key, short side, long side)`` of every training input the data keys make."""
        raise NotImplementedError

    def input_sides(self) -> list[tuple[str, int, int]]:
        """``(key, short side, long side)`` of every model input, training and evaluation
        (the config checks read them)."""
        raise NotImplementedError

    def describe_training(self) -> str:
        """The training sizes in a few words (``"480-800"``, ``"640 (batches at
        480-800)"``)."""
        raise NotImplementedError

    def batch_scales(self, epoch: int) -> list[int]:
        """The sides the training batches of ``epoch`` are resized to ([]: none)."""
        return []

    def report_sizes(self) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
        """What the data report scales objects with (:attr:`name` says how): ``(training
        sizes, evaluation sizes, cap of the longer side or None)``, sizes increasing."""
        raise NotImplementedError

    def memory_estimate(self) -> tuple[dict[str, int], dict[str, int],
                                       Callable[[dict[str, int], int], tuple[int, int]], str]:
        """What the memory check reads: ``(values, defaults, shape, what)``: the data keys
        that set the largest batch and their defaults, ``shape(values, batch) -> (height,
        width)`` of that batch, and what the estimate covers."""
        raise NotImplementedError

    def eval_resize(self, size: EvalSize | None = None) -> Resize:
        """The evaluation resize at the config's own size (``size=None``) or at a test
        size of ``--sizes`` (:func:`detr_irpe.data.transforms.resize_transform` builds
        it)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ShorterSideRule(ResizeRule):
    """DETR's rule: shorter side drawn from ``train_scales`` (training) or ``val_size``
    (evaluation), longer side about ``max_size``; any size."""

    name: ClassVar[str] = "shorter"
    augmentations: ClassVar[tuple[str, ...]] = ("detr", "simple")

    train_scales: tuple[int, ...]
    val_size: int
    max_size: int

    @classmethod
    def from_data(cls, data: Any) -> ShorterSideRule:
        return cls(tuple(data.train_scales), int(data.val_size), int(data.max_size))

    @property
    def eval_key(self) -> str:
        return "data.val_size"

    @property
    def eval_side(self) -> int:
        return self.val_size

    def capped(self, size: EvalSize) -> tuple[int, int]:
        """``(shorter side, cap of the longer side)`` at a shorter-side test size."""
        return size.capped(self.val_size, self.max_size)

    def largest_input(self, size: EvalSize, batch: int) -> tuple[int, int]:
        shape = self.fixed_shape(size)
        if shape is not None:
            return shape
        # a portrait and a landscape image pad each other to the cap of both sides
        short, cap = self.capped(size)
        return (cap, cap) if batch > 1 else (short, cap)

    def image_input(self, size: int | None = None) -> dict[str, Any]:
        return {"size": size or self.val_size, "square": None}

    def train_sides(self) -> list[tuple[str, int, int]]:
        return [("data.train_scales", s, max(s, self.max_size)) for s in self.train_scales]

    def input_sides(self) -> list[tuple[str, int, int]]:
        return [*self.train_sides(),
                ("data.val_size", self.val_size, max(self.val_size, self.max_size))]

    def describe_training(self) -> str:
        return _span(self.train_scales)

    def report_sizes(self) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
        return tuple(sorted(set(self.train_scales))), (self.val_size,), self.max_size

    def memory_estimate(self) -> tuple[dict[str, int], dict[str, int],
                                       Callable[[dict[str, int], int], tuple[int, int]], str]:
        # The largest padded batch: the longer side is at most data.max_size, and with two
        # images or more a portrait and a landscape one pad each other to a square.
        shorter = max([*self.train_scales, self.val_size])
        key = ("data.val_size" if self.val_size >= max(self.train_scales)
               else "data.train_scales")

        def shape(v: dict[str, int], batch: int) -> tuple[int, int]:
            side = v["data.max_size"]
            return (side if batch > 1 else min(v[key], side)), side

        return ({"data.max_size": self.max_size, key: shorter},
                {"data.max_size": 1333, key: 800}, shape,
                "one forward pass of a padded batch (images, the first backbone activation, "
                "iRPE ids and logits)")

    def eval_resize(self, size: EvalSize | None = None) -> Resize:
        if size is None:
            return Resize(short=self.val_size, cap=self.max_size)
        if size.shape is not None:
            return Resize(shape=size.shape)
        short, cap = self.capped(size)
        return Resize(short=short, cap=cap)


@dataclass(frozen=True)
class SquareRule(ResizeRule):
    """RT-DETR's / D-FINE's rule: ``train_size`` squares (each batch then one of
    ``batch_scales`` until ``batch_scales_stop_epoch``), ``eval_size`` squares at
    evaluation (aspect ratio not kept); a test size ``S`` means ``S x S``; the model pads
    each side to a multiple of 32."""

    name: ClassVar[str] = "square"
    augmentations: ClassVar[tuple[str, ...]] = ("rtdetr",)
    stride: ClassVar[int] = 32

    train_size: int
    eval_size: int
    scales: tuple[int, ...] = ()
    scales_stop_epoch: int | None = None

    @classmethod
    def from_data(cls, data: Any) -> SquareRule:
        return cls(int(data.train_size), int(data.eval_size), tuple(data.batch_scales),
                   data.batch_scales_stop_epoch)

    @property
    def eval_key(self) -> str:
        return "data.eval_size"

    @property
    def eval_side(self) -> int:
        return self.eval_size

    @property
    def eval_shape(self) -> tuple[int, int]:
        return self.eval_size, self.eval_size

    def fixed_shape(self, size: EvalSize) -> tuple[int, int]:
        if size.shape is not None:
            return size.shape
        assert size.short is not None
        return size.short, size.short

    def image_input(self, size: int | None = None) -> dict[str, Any]:
        # a shorter side asked for (--size) is honoured as one; else the square
        return {"size": size, "square": None} if size else {"size": None,
                                                             "square": self.eval_size}

    def train_sides(self) -> list[tuple[str, int, int]]:
        sides = [("data.train_size", self.train_size)]
        sides += [("data.batch_scales", s) for s in self.scales]
        return [(key, s, s) for key, s in sides]

    def input_sides(self) -> list[tuple[str, int, int]]:
        sides = self.train_sides()
        sides.insert(1, ("data.eval_size", self.eval_size, self.eval_size))
        return sides

    def describe_training(self) -> str:
        if len(set(self.scales)) > 1:
            stop = ("" if self.scales_stop_epoch is None
                    else f" until epoch {self.scales_stop_epoch}")
            return f"{self.train_size} (batches at {_span(self.scales)}{stop})"
        return str(self.train_size)

    def report_sizes(self) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
        return tuple(sorted(set(self.scales)) or [self.train_size]), (self.eval_size,), None

    def batch_scales(self, epoch: int) -> list[int]:
        stop = self.scales_stop_epoch
        return list(self.scales) if stop is None or epoch < stop else []

    def memory_estimate(self) -> tuple[dict[str, int], dict[str, int],
                                       Callable[[dict[str, int], int], tuple[int, int]], str]:
        # every batch is squares of one side, the largest of the three keys (data.max_size
        # is not read here)
        candidates = {"data.train_size": self.train_size, "data.eval_size": self.eval_size}
        if self.scales:
            candidates["data.batch_scales"] = max(self.scales)
        key = max(candidates, key=candidates.__getitem__)

        def shape(v: dict[str, int], batch: int) -> tuple[int, int]:
            return v[key], v[key]

        return ({key: candidates[key]}, {key: 640}, shape,
                "one forward pass of a batch of squares (images, the first backbone "
                "activation, iRPE ids and logits)")

    def eval_resize(self, size: EvalSize | None = None) -> Resize:
        if size is None:
            return Resize(square=self.eval_size)
        return Resize(shape=self.fixed_shape(size))


# The rule each recipe of random ops was written for: the rule of a config whose family's
# rule does not take its data.augmentation, and of a data section on its own.
AUGMENTATION_RULES: dict[str, type[ResizeRule]] = {
    "detr": ShorterSideRule,
    "simple": ShorterSideRule,
    "rtdetr": SquareRule,
}


def resize_rule(cfg: Any, family: str | None = None) -> ResizeRule:
    """The resize rule of a config (``cfg``: a whole ``Config``, or a ``data`` section).

    The family is ``cfg.model.family`` for a whole config, ``family`` when given, else the
    one a ``Config`` noted on its ``data`` section (:meth:`Config.__post_init__`); its
    registered rule is taken when it takes ``data.augmentation``, else the rule that recipe
    was written for (:data:`AUGMENTATION_RULES`)."""
    data = getattr(cfg, "data", cfg)
    model = getattr(cfg, "model", None)
    if family is None:
        family = getattr(model, "family", None) or getattr(data, "family", None)
    if family is not None:
        make = get_family(family).resize_rule
        if make is not None:
            rule = make(data)
            if data.augmentation in rule.augmentations:
                return rule
    return AUGMENTATION_RULES[data.augmentation].from_data(data)
