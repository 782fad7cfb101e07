"""ONNX export of a detector of any registered family: DETR / DETR-iRPE, DAB-DETR /
DN-DETR, RT-DETR (``torch.onnx.export`` with ``dynamo=True``).

The exported graph is the family's ``onnx_wrapper`` (:mod:`detr_irpe.family`; default
:class:`ImagesToPredictions`): one input ``images`` ``(N, 3, H, W)`` (normalised as at
evaluation, every pixel valid: no padding mask) and two outputs, ``pred_logits`` and
``pred_boxes`` ``(N, Q, 4)`` (cx, cy, w, h relative to the image). DETR's logits are
``(N, Q, num_classes + 1)`` (softmax, the last column "no object"); those of the
families with sigmoid classes (DAB-DETR, RT-DETR) ``(N, Q, num_classes)``. The graph is the
inference one: DN-DETR's denoising queries exist only in training, so a DN model exports
as its DAB-DETR graph. Post-processing (softmax and dropping the no-object class, or
sigmoid and the top-k (query, class) pairs; box conversion) stays outside the graph;
docs/deployment.md shows both.

While exporting, the iRPE attention takes its export form (see
:func:`detr_irpe.attention.choose_impl`): plain gather / scatter-add ops, and bucket
ids computed by traced tensor ops from the feature-map size, so a ``dynamic`` export
serves any image size (and batch size) with the ids computed inside the graph.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from detr_irpe import sizes
from detr_irpe.attention import MultiheadAttention
from detr_irpe.encodings.irpe import irpe_entry
from detr_irpe.errors import ExportError
from detr_irpe.family import family_of_model
from detr_irpe.models.position_encoding import PositionEmbeddingLearned
from detr_irpe.structures import ImageBatch
from detr_irpe.utils.files import atomic_write
from detr_irpe.utils.torch_logs import torch_logs_to_debug

logger = logging.getLogger(__name__)

IMAGE_INPUT = "images"
OUTPUTS = ("pred_logits", "pred_boxes")
# torch.onnx's exporter (dynamo=True) writes opset 18 or newer
MIN_OPSET = 18
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
# the steps export_onnx logs as "ONNX export i/3: ..." when each starts and ends
EXPORT_STAGES = ("trace", "translate", "write")
# the traced batch of a dynamic export: torch.export specialises a size-1 dimension
_DYNAMIC_TRACE_BATCH = 2
# the detectors export_onnx takes: any registered family's
Detector = nn.Module


class ImagesToPredictions(nn.Module):
    """A detector as ``images -> (pred_logits, pred_boxes)`` with an all-False padding mask:
    the wrapper of the families that name none (DETR, DAB-DETR / DN-DETR).

    A family's own wrapper (``DetectorFamily.onnx_wrapper``) has the same interface: the
    forward, ``stride`` (the coarsest feature stride), ``check_size(size, dynamic)``
    (raises :class:`ExportError` for a size its graph cannot take) and
    ``dynamic_shapes(input_name)`` (the symbolic dimensions of ``torch.export``).

    Args:
        model: a DETR or DAB-DETR (its ``aux_outputs`` and the DAB ``anchors`` are not
            exported; in eval mode a DN-DETR builds no denoising queries).
    """

    def __init__(self, model: Detector) -> None:
        super().__init__()
        self.model = model

    # the stride assumed for a model without the package's backbone (a plugin family's)
    DEFAULT_STRIDE = 32

    @property
    def stride(self) -> int:
        """The backbone's output stride (32, or 16 with DC5), for a model built on the
        package's ``Joiner`` backbone; :data:`DEFAULT_STRIDE` otherwise."""
        backbone = self._backbone()
        return backbone[0].stride if backbone is not None else self.DEFAULT_STRIDE

    def _backbone(self) -> nn.Module | None:
        backbone = getattr(self.model, "backbone", None)
        return backbone if isinstance(backbone, nn.Sequential) and len(backbone) == 2 else None

    def _learned_position(self) -> PositionEmbeddingLearned | None:
        backbone = self._backbone()
        position = backbone[1] if backbone is not None else None
        return position if isinstance(position, PositionEmbeddingLearned) else None

    def check_size(self, size: tuple[int, int], dynamic: bool) -> None:
        """Refuse a size the graph cannot represent (a dynamic side of one cell, a map
        larger than a learned position embedding)."""
        stride = self.stride
        if dynamic and min(size) <= stride:
            raise ExportError(
                f"--dynamic traces the model at --size {size[0]}x{size[1]}, which gives a "
                f"feature map side of 1 at stride {stride}; pass a size above {stride} pixels "
                "per side (a size-1 dimension cannot stay symbolic)")
        position = self._learned_position()
        cells = [-(-side // stride) for side in size]
        if position is not None and max(cells) > position.max_size:
            raise ExportError(
                f"--size {size[0]}x{size[1]} gives a {cells[0]}x{cells[1]} feature map, "
                f"larger than the learned position embedding's "
                f"{position.max_size}x{position.max_size}; export at most "
                f"{position.max_size * stride} pixels per side")

    def dynamic_shapes(self, input_name: str) -> dict[str, dict[int, torch.export.Dim]]:
        """Symbolic batch, height and width of ``images``, in the ranges the model supports."""
        stride = self.stride
        position = self._learned_position()
        side_max = position.max_size * stride if position is not None else None
        dims = {"min": stride + 1} if side_max is None else {"min": stride + 1,
                                                             "max": side_max}
        return {input_name: {
            0: torch.export.Dim("batch", min=1),
            2: torch.export.Dim("height", **dims),
            3: torch.export.Dim("width", **dims),
        }}

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """``(N, 3, H, W)`` -> ``(N, Q, num_classes + 1)`` logits (``num_classes`` for the
        dab decoder), ``(N, Q, 4)`` boxes."""
        batch, _, height, width = images.shape
        mask = torch.zeros((batch, height, width), dtype=torch.bool, device=images.device)
        out = self.model(ImageBatch(images, mask))
        return out["pred_logits"], out["pred_boxes"]


def onnx_wrapper(model: Detector) -> nn.Module:
    """``model`` as ``images -> (pred_logits, pred_boxes)``: its family's ``onnx_wrapper``,
    or :class:`ImagesToPredictions` (the model itself is wrapped, not copied)."""
    family = family_of_model(model)
    if family is not None and family.onnx_wrapper is not None:
        return family.onnx_wrapper(model)
    return ImagesToPredictions(model)


def parse_size(text: str) -> tuple[int, int]:
    """``"HxW"`` (e.g. ``"800x1216"``) -> ``(H, W)``; anything else is an :class:`ExportError`."""
    match = _SIZE.match(str(text))
    if match is None or min(int(match[1]), int(match[2])) <= 0:
        raise ExportError(f"--size {text!r} must be HEIGHTxWIDTH in pixels, e.g. 800x1216")
    return int(match[1]), int(match[2])


def check_input_size(
    size: tuple[int, int], batch: int, *, dynamic: bool = False, model: Detector | None = None
) -> None:
    """Refuse an input that one forward pass could not hold in this machine's memory.

    Without ``model`` (before it is loaded) only the input images and the first backbone
    activation count; with it, also the iRPE bucket ids and logits of its feature map
    (:func:`detr_irpe.sizes.forward_bytes`).

    Raises:
        ExportError: naming ``--size`` or ``--batch`` (the one to lower), the estimate and
            the limit.
    """
    batch = max(batch, _DYNAMIC_TRACE_BATCH) if dynamic else batch
    extra: dict = {}
    if model is not None:
        attention = next((m for m in model.modules() if isinstance(m, MultiheadAttention)),
                         None)
        extra = {"stride": onnx_wrapper(model).stride,
                 "nheads": getattr(attention, "num_heads", 1),
                 "irpe": attention is not None and irpe_entry(attention) is not None}
    limit, machine = sizes.memory_limit()
    total = sizes.forward_bytes(batch=batch, height=size[0], width=size[1], **extra)
    if total <= limit:
        return
    one = sizes.forward_bytes(batch=1, height=size[0], width=size[1], **extra)
    named = f"--size {size[0]}x{size[1]}" if one > limit else f"--batch {batch}"
    raise ExportError(
        f"{named}: one forward pass of {batch} x 3 x {size[0]} x {size[1]} images needs at "
        f"least {sizes.format_bytes(total)} (estimated: the images, the first backbone "
        f"activation{', iRPE ids and logits' if extra.get('irpe') else ''}), more than "
        f"{machine}; export at a smaller {named.split()[0]}")


def _require_exporter() -> None:
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"ONNX export needs {' and '.join(missing)}: "
                          "pip install 'detr_irpe[onnx]'")


def _check_settings(
    model: Detector, size: tuple[int, int], batch: int, dynamic: bool, opset: int
) -> None:
    """Refuse, with the reason, what the exported graph could not represent."""
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} is not supported: torch.onnx's exporter writes "
                          f"opset {MIN_OPSET} or newer; pass --opset {MIN_OPSET} or more")
    if batch <= 0:
        raise ExportError(f"batch size must be positive, got {batch}")
    check_input_size(size, batch, dynamic=dynamic, model=model)
    onnx_wrapper(model).check_size(size, dynamic)


def _to_onnx_bytes(
    wrapper: nn.Module, images: Tensor, dynamic_shapes: dict | None, opset: int
) -> bytes:
    """The serialised ONNX model; exporter failures become one-line :class:`ExportError` s.

    The two slow steps run one after the other so that each is logged as it starts and
    ends (a DETR-R50 takes about a minute): tracing the model into an ``ExportedProgram``
    (what ``torch.onnx.export`` does first, non-strict), then translating it into ONNX.
    The dynamic shapes go to both, so the symbolic dimensions keep their names. The
    exporter's own log lines and warnings go to logging at DEBUG
    (:func:`~detr_irpe.utils.torch_logs.torch_logs_to_debug`).
    """
    try:
        # torch's own lines (fake_tensor's tracebacks of a failed trace, onnxscript's notes
        # on each optimisation) go to logging at DEBUG: the console keeps one line
        with torch.no_grad(), torch_logs_to_debug():
            started = _stage_start(1, "trace the model (torch.export)")
            traced = torch.export.export(wrapper, (images,), dynamic_shapes=dynamic_shapes,
                                         strict=False)
            _stage_done(1, started)
            started = _stage_start(2, "translate it to ONNX and optimise the graph (torch.onnx)")
            program = torch.onnx.export(
                traced, (images,), input_names=[IMAGE_INPUT], output_names=list(OUTPUTS),
                dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                external_data=False, verbose=False,
            )
            _stage_done(2, started)
    except Exception as err:  # the exporter raises many types, none of them user errors
        logger.debug("torch.onnx.export failed", exc_info=True)
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        raise ExportError(f"torch.onnx could not export this model ({type(err).__name__}: "
                          f"{first})") from err
    return program.model_proto.SerializeToString()


def _stage_start(number: int, what: str) -> float:
    logger.info("ONNX export %d/%d: %s ...", number, len(EXPORT_STAGES), what)
    return time.perf_counter()


def _stage_done(number: int, started: float) -> None:
    logger.info("ONNX export %d/%d: %s done in %.1f s", number, len(EXPORT_STAGES),
                EXPORT_STAGES[number - 1], time.perf_counter() - started)


def export_onnx(
    model: Detector,
    path: str | Path,
    size: tuple[int, int],
    *,
    batch: int = 1,
    dynamic: bool = False,
    opset: int = MIN_OPSET,
) -> Path:
    """Write ``model`` as an ONNX file (atomically: a temporary file, then a rename).

    Args:
        model: a detector of any registered family (any iRPE setting); a copy of it,
            wrapped by its family's ``onnx_wrapper``, is exported
            in eval mode on the CPU in float32, the model itself is left as it is.
        path: the ``.onnx`` file to write (a single self-contained file).
        size: ``(H, W)`` of the input images in pixels.
        batch: the batch size N of a static export.
        dynamic: any N, H and W at run time instead of the traced ``batch`` and ``size``
            (iRPE bucket ids are then computed inside the graph).
        opset: ONNX opset version (at least :data:`MIN_OPSET`).

    Returns:
        ``path``.

    Raises:
        ExportError: a setting the graph cannot represent, a missing ``onnx`` extra or an
            exporter failure; the message says which and why.
    """
    _require_exporter()
    _check_settings(model, size, batch, dynamic, opset)
    # a CPU float32 copy in eval mode: the caller's model keeps its device, dtype and mode
    wrapper = onnx_wrapper(copy.deepcopy(model)).to("cpu", torch.float32).eval()
    trace_batch = _DYNAMIC_TRACE_BATCH if dynamic else batch
    images = torch.randn(trace_batch, 3, *size)
    logger.info("exporting to ONNX (opset %d, %s input %s)", opset,
                "dynamic" if dynamic else "static", "N x 3 x H x W" if dynamic
                else f"{batch} x 3 x {size[0]} x {size[1]}")
    data = _to_onnx_bytes(wrapper, images,
                          wrapper.dynamic_shapes(IMAGE_INPUT) if dynamic else None, opset)
    started = _stage_start(3, f"write {path}")
    path = atomic_write(path, lambda f: f.write(data))
    _stage_done(3, started)
    logger.info("wrote %s (%.1f MB)", path, len(data) / 2**20)
    return path


def run_onnx(path: str | Path, images: Tensor) -> tuple[Tensor, Tensor]:
    """Run an exported file with onnxruntime on the CPU: ``images`` ``(N, 3, H, W)`` ->
    ``(pred_logits, pred_boxes)`` as tensors (to compare with PyTorch)."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise ExportError("running an ONNX file needs onnxruntime: pip install 'detr_irpe[onnx]'")
    import onnxruntime  # optional (the onnx extra): checked for just above

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits, boxes = session.run(list(OUTPUTS), {IMAGE_INPUT: images.detach().cpu().numpy()})
    return torch.from_numpy(logits), torch.from_numpy(boxes)
