"""Size limits: the bytes that sizes in a config (or an export) imply, against this machine.

A size such as ``model.num_queries=1000000000000`` or an export at 100000x100000 pixels
would otherwise fail deep inside PyTorch, after minutes, with a multi-terabyte allocation
(or be killed by the kernel). Here the largest tensors the sizes imply are estimated in
closed form, without allocating anything, and compared with the memory of this machine:
its physical RAM, or the container's (cgroup) limit when that is lower. The model is
built on the CPU before it moves to a GPU, so RAM is the limit every run meets first.

The estimates are lower bounds (float32 parameters only, no gradients or optimizer
state; only the tensors one forward pass must hold), so a refused size can never work
here; one that passes may still not fit a GPU. The whole machine's memory, not what is
free at the moment, is the limit: a check must not depend on what else runs.

The test sizes of ``tools/eval.py --sizes`` and of a grid's ``eval_sizes`` are read here
too (:func:`parse_eval_size`, without torch, so that a tool refuses a bad one at once):
``S`` resizes the shorter side to ``S`` with the longer side capped at the config's
``data.max_size`` scaled by ``S / data.val_size``; ``HxW`` resizes to exactly ``H`` x ``W``
pixels (docs/evaluation.md, "Test sizes").
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EVAL_SIDE_RANGE",
    "EvalSize",
    "denoising_mask_bytes",
    "forward_bytes",
    "format_bytes",
    "largest_value_to_blame",
    "memory_limit",
    "parameter_bytes",
    "parse_eval_size",
    "parse_eval_sizes",
]

FLOAT32 = 4
INT64 = 8
# Used when the system does not say how much memory it has (no sysconf, e.g. Windows).
FALLBACK_LIMIT = 2**40
# input_proj of DETR: the largest backbone output (ResNet-50 / 101: 2048 channels)
_BACKBONE_CHANNELS = 2048
# A ResNet stem: 64 channels at stride 2, i.e. 16 floats per input pixel
_STEM_FLOATS_PER_PIXEL = 16

_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit() -> tuple[int, str]:
    """``(bytes, description)`` of the memory this process can have at most."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        physical = None
    limit, what = (FALLBACK_LIMIT, "1 TiB (this system does not report its memory)") \
        if not physical or physical <= 0 else (physical, "physical RAM")
    for name in _CGROUP_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < limit:
            limit, what = int(text), f"the container's limit, {name}"
        break
    return limit, f"this machine's {format_bytes(limit)} of memory ({what})"


def format_bytes(count: float) -> str:
    """``1.5 GiB`` style (``3.2e+06 EiB`` beyond)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if count < 1024 or unit == "EiB":
            break
        count /= 1024
    if unit == "B":
        return f"{count:.0f} B"
    return f"{count:.1f} {unit}" if count < 1024 else f"{count:.2g} {unit}"


def parameter_bytes(
    *, hidden_dim: int, enc_layers: int, dec_layers: int, dim_feedforward: int,
    num_queries: int, num_classes: int | None, rpe_table_floats: int = 0,
) -> int:
    """Float32 bytes of a DETR's transformer, heads and queries (the backbone, bounded,
    is left out). ``rpe_table_floats``: the iRPE table entries of one encoder layer."""
    h, ff = hidden_dim, dim_feedforward
    encoder = enc_layers * (4 * h * h + 2 * h * ff + rpe_table_floats)  # attention + FFN
    decoder = dec_layers * (8 * h * h + 2 * h * ff)  # self- and cross-attention + FFN
    heads = h * ((num_classes or 0) + 1) + 2 * h * h + 4 * h  # class and box heads
    return FLOAT32 * (encoder + decoder + heads + num_queries * h + _BACKBONE_CHANNELS * h)


def forward_bytes(
    *, batch: int, height: int, width: int, stride: int = 32, nheads: int = 1,
    irpe: bool = False,
) -> int:
    """Bytes that one forward pass must hold at once for a padded batch of images.

    The float32 images, the first activation of a ResNet stem (64 channels at stride 2),
    and with iRPE the int64 bucket ids ``(L, L)`` of the ``L`` feature-map cells and the
    attention logits ``(B, heads, L, L)`` that its relative-position terms fill.
    """
    pixels = batch * height * width
    tokens = math.ceil(height / stride) * math.ceil(width / stride)
    total = FLOAT32 * pixels * (3 + _STEM_FLOATS_PER_PIXEL)
    if irpe:
        total += INT64 * tokens * tokens + FLOAT32 * batch * nheads * tokens * tokens
    return total


def denoising_mask_bytes(*, num_queries: int, groups: int, objects_per_image: int = 1) -> int:
    """Bytes of DN-DETR's decoder self-attention mask: one bool ``(P + Q, P + Q)`` tensor,
    ``P = groups * S`` denoising queries for ``S`` objects in the fullest image of a batch
    (one at least: a batch without objects has no denoising queries and needs no check)."""
    side = num_queries + groups * objects_per_image
    return side * side


def largest_value_to_blame(
    estimate: Callable[[Mapping[str, int]], int], values: Mapping[str, int],
    defaults: Mapping[str, int],
) -> str:
    """The key whose reset to its default shrinks ``estimate(values)`` the most (the size
    a user should lower)."""
    def without(key: str) -> int:
        return estimate({**values, key: defaults[key]})

    return min(defaults, key=without)


# A test size's sides, in pixels: below 16 a ResNet's stride-32 map has no cell to spare;
# above 8192 a number is a typo (an extra digit), not a test size.
EVAL_SIDE_RANGE = (16, 8192)
_SHAPE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class EvalSize:
    """One test size: ``short`` (the shorter side, longer side capped) or an exact
    ``(height, width)`` shape; exactly one of the two is set."""

    short: int | None = None
    shape: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """``"640"`` or ``"640x1280"`` (HEIGHTxWIDTH): the table's row and the folder's name."""
        return str(self.short) if self.shape is None else f"{self.shape[0]}x{self.shape[1]}"

    def capped(self, val_size: int, max_size: int) -> tuple[int, int]:
        """``(shorter side, cap of the longer side)`` of a ``short`` size: the config's cap
        ``max_size`` scaled by ``short / val_size`` (rounded), so that every size keeps
        the config's bound on the aspect ratio (800 / 1333 -> 1024 / 1706)."""
        if self.short is None:
            raise ValueError(f"test size {self.label} is a fixed shape, not a shorter side")
        return self.short, max(self.short, round(max_size * self.short / val_size))


def _side(text: str, value: int, what: str) -> int:
    low, high = EVAL_SIDE_RANGE
    if not low <= value <= high:
        raise ValueError(f"test size {text!r}: {what} {value} is outside {low}..{high} pixels")
    return value


def parse_eval_size(text: object) -> EvalSize:
    """``"640"`` / ``640`` -> the shorter side 640; ``"640x1280"`` -> exactly 640 high and
    1280 wide. Raises ``ValueError`` naming the value when it is neither, or a side is
    outside :data:`EVAL_SIDE_RANGE`."""
    if isinstance(text, bool):
        raise ValueError(f"test size {text!r} is not a number of pixels or HEIGHTxWIDTH")
    if isinstance(text, int):
        return EvalSize(short=_side(str(text), text, "the shorter side"))
    raw = str(text).strip()
    shape = _SHAPE.match(raw)
    if shape:
        height, width = (int(g) for g in shape.groups())
        return EvalSize(shape=(_side(raw, height, "the height"), _side(raw, width, "the width")))
    if re.fullmatch(r"[+-]?\d+", raw):
        return EvalSize(short=_side(raw, int(raw), "the shorter side"))
    raise ValueError(f"test size {raw!r} is not a number of pixels (e.g. 640) or "
                     "HEIGHTxWIDTH (e.g. 640x1280)")


def parse_each(values: Iterable[object], name: str, parse: Callable[[object], Any]
               ) -> list[Any]:
    """Each of ``values`` (the setting ``name``: a flag, a grid key) as ``parse`` reads it
    (a result with a ``label``), in the order given. Raises ``ValueError`` starting with
    ``name``: the bad value, or ``"<name> lists 64 more than once"``."""
    try:
        parsed = [parse(value) for value in values]
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    labels = [p.label for p in parsed]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"{name} lists {', '.join(twice)} more than once")
    return parsed


def parse_eval_sizes(values: Iterable[object], name: str) -> list[EvalSize]:
    """Each of ``values`` as :func:`parse_eval_size` reads it (:func:`parse_each`)."""
    return parse_each(values, name, parse_eval_size)
