"""The runtime a detector's inference runs in: one switch for the predictor and the tools.

- ``pytorch``: the model as trained (every module as it is; the attention figures and
  the losses need this form).
- ``fused``: the inference form of the same weights (:func:`~detr_irpe.models.fusion.
  fuse_for_inference`: batch norms folded into the convolutions, RepVGG blocks merged;
  on the CPU also the channels-last layout). The same function to float32 rounding;
  about 15 % (folding) and 25 % (with channels-last) less time for RT-DETR-R50 at 640 on
  the CPU (docs/benchmarks.md, "Eager PyTorch against ONNX Runtime").
- ``compiled``: the inference form compiled by ``torch.compile`` (Inductor, with its
  weights frozen into the graph: convolutions with their activations and prepacked
  weights, elementwise work fused). Compiled once per input size on first use (about a
  minute for D-FINE-L at 640 on 2 CPU cores), so it pays off for many images of one size
  (RT-DETR / D-FINE evaluate at one size). Where the compiler cannot run (no C++
  compiler on the CPU, an unsupported platform) it logs a warning once and runs the
  ``fused`` form: the same outputs either way, to float32 rounding.
- ``onnxruntime``: the model exported to ONNX with a dynamic size (cached in a folder:
  exported once per weights), checked once against PyTorch on the first input, and run by
  ONNX Runtime on the CPU (the ``onnx`` extra). One image per call (the exported graph
  reads no padding mask); the outputs are ``pred_logits`` and ``pred_boxes``, post-processed
  exactly as PyTorch's.

:func:`build_runtime` returns a callable ``images -> outputs`` with the model's own
input forms (a list of ``(3, H, W)`` tensors or a batch) and its outputs dict.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from detr_irpe.errors import ConfigError, DetrIrpeError
from detr_irpe.export.onnx import export_onnx, onnx_wrapper
from detr_irpe.models.fusion import inference_form
from detr_irpe.structures import ImageBatch

logger = logging.getLogger(__name__)

__all__ = ["RUNTIMES", "CompiledModel", "OnnxRuntimeModel", "build_runtime",
           "compile_frozen", "compiler_problem", "runtime_cache_dir"]

RUNTIMES = ("pytorch", "fused", "compiled", "onnxruntime")
# largest |ONNX Runtime - PyTorch| of the first call's outputs that is float32 rounding
CHECK_ATOL = 1e-3


def runtime_cache_dir() -> Path:
    """Where exported graphs are kept: ``$DETR_IRPE_CACHE/onnx`` (default
    ``~/.cache/detr_irpe/onnx``)."""
    root = os.environ.get("DETR_IRPE_CACHE") or Path.home() / ".cache" / "detr_irpe"
    return Path(root) / "onnx"


def _weights_digest(model: nn.Module) -> str:
    """A digest of the model's weights and structure: the cache key of its graph."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:20]


def compiler_problem(device: torch.device | str = "cpu") -> str | None:
    """Why ``torch.compile`` cannot build code for ``device`` here, or None: on the CPU,
    Inductor needs a C++ compiler (``CXX`` or one it finds)."""
    if torch.device(device).type != "cpu":
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # noqa: PLC0415
        get_cpp_compiler()
    except ImportError:
        return None  # another PyTorch layout: the first call tells
    except Exception as err:  # noqa: BLE001 (whatever the lookup raises is the reason)
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def compile_frozen(module: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(module)`` for inference, with Inductor's freezing on while it
    compiles (the weights become constants of the graph: folded, prepacked for the CPU's
    convolution and matrix kernels). Freezing is set around each call because compilation
    happens at the first call of each input shape; passed as
    ``options={"freezing": True}`` it did not take effect (D-FINE-L at 640 on 2 cores ran
    at 394 ms that way against 327 ms, Intel Xeon AMX, 2026-12-04)."""
    compiled = torch.compile(module, dynamic=False)

    def run(*args: Any, **kwargs: Any) -> Any:
        from torch._inductor import config as inductor_config  # noqa: PLC0415 (torch's)

        with inductor_config.patch(freezing=True):
            return compiled(*args, **kwargs)

    return run


class CompiledModel:
    """A detector's inference form compiled by ``torch.compile`` (Inductor, weights frozen
    into the graph), called like the model in eval mode; the ``fused`` form where the
    compiler cannot run (a warning names why, once).

    Args:
        model: the detector (eval mode).
        device: where it runs.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = inference_form(model, device)
        self.fallback_reason = compiler_problem(device)
        self._compiled = None
        if self.fallback_reason is None:
            self._compiled = compile_frozen(self.model)
        else:
            self._warn()
        self._sizes: set[tuple[int, ...]] = set()

    def _warn(self) -> None:
        logger.warning("runtime compiled: torch.compile cannot run here (%s); running the "
                       "fused form instead (the same outputs, slower)", self.fallback_reason)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            return self.model(*args, **kwargs)
        shape = _input_shape(args[0]) if args else ()
        if shape not in self._sizes:
            logger.info("runtime compiled: compiling for inputs of shape %s (once per "
                        "shape; about a minute for a large model on a few CPU cores)",
                        "x".join(map(str, shape)) or "?")
            self._sizes.add(shape)
        try:
            return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as err:  # noqa: SLF001
            self.fallback_reason = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            self._compiled = None
            self._warn()
            return self.model(*args, **kwargs)

    def eval(self) -> CompiledModel:  # called like a module
        return self


def _input_shape(images: Any) -> tuple[int, ...]:
    """The shape that decides a recompilation: a batch's, or the first image's."""
    if isinstance(images, ImageBatch):
        return tuple(images.tensors.shape)
    if isinstance(images, Tensor):
        return tuple(images.shape)
    if isinstance(images, (list, tuple)) and images and isinstance(images[0], Tensor):
        return (len(images), *images[0].shape)
    return ()


class OnnxRuntimeModel:
    """A detector run by ONNX Runtime, called like the model in eval mode.

    Args:
        model: the detector (eval mode); exported on construction unless its graph is in
            the cache.
        cache_dir: the cache folder (default :func:`runtime_cache_dir`).
        threads: ONNX Runtime's intra-op threads (default: torch's).
    """

    def __init__(self, model: nn.Module, cache_dir: str | Path | None = None,
                 threads: int | None = None) -> None:
        if importlib.util.find_spec("onnxruntime") is None:
            raise ConfigError("runtime onnxruntime needs the onnx extra: pip install "
                              "'detr_irpe[onnx]'")
        import onnxruntime  # optional (the onnx extra): checked for just above

        self.model = model.eval()
        self._wrapper = onnx_wrapper(self.model)
        folder = Path(cache_dir) if cache_dir is not None else runtime_cache_dir()
        self.path = folder / f"{type(model).__name__.lower()}_{_weights_digest(model)}.onnx"
        if not self.path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            logger.info("exporting the model to %s for ONNX Runtime (once per weights)",
                        self.path)
            export_onnx(self.model, self.path, (64, 64), dynamic=True)
        else:
            logger.info("ONNX Runtime graph from the cache: %s", self.path)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        self.session = onnxruntime.InferenceSession(str(self.path), options,
                                                    providers=["CPUExecutionProvider"])
        self._input = self.session.get_inputs()[0].name
        self.checked = False

    def _run(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """The graph on ``images``; a graph made for sides that are multiples of a stride
        (RT-DETR's: 32) gets the images padded at the bottom / right to one, and its boxes
        are rescaled to the unpadded image, as the PyTorch model does itself."""
        height, width = images.shape[-2:]
        # a graph whose sides must be multiples of its stride says how to pad to one
        stride = getattr(self._wrapper, "stride", None) if hasattr(
            self._wrapper, "padding_value") else None
        pad_h, pad_w = (-height % stride, -width % stride) if stride else (0, 0)
        if pad_h or pad_w:
            value = self._wrapper.padding_value().to(images.dtype).view(1, 3, 1, 1)
            padded = value.expand(images.shape[0], 3, height + pad_h, width + pad_w).clone()
            padded[..., :height, :width] = images
            images = padded
        logits, boxes = self.session.run(None, {self._input: images.detach().cpu().numpy()})
        logits, boxes = torch.from_numpy(logits), torch.from_numpy(boxes)
        if pad_h or pad_w:
            scale = torch.tensor([(width + pad_w) / width, (height + pad_h) / height] * 2)
            boxes = boxes * scale
        return logits, boxes

    def _check(self, images: Tensor, got: tuple[Tensor, Tensor]) -> None:
        with torch.no_grad():
            want = self._wrapper(images)
        diff = max(float((a - b.cpu()).abs().max()) for a, b in zip(got, want))
        if not diff <= CHECK_ATOL:
            raise DetrIrpeError(f"ONNX Runtime's outputs differ from PyTorch's by {diff:.2e} "
                                f"(more than {CHECK_ATOL:g}) for {self.path}; delete the file "
                                "to export again, or use --runtime pytorch")
        logger.info("ONNX Runtime checked against PyTorch: largest difference %.1e", diff)
        self.checked = True

    def __call__(self, images: Sequence[Tensor] | Tensor | ImageBatch,
                 targets: Any = None) -> dict[str, Tensor]:
        """``images``: ``(3, H, W)`` tensors, a ``(B, 3, H, W)`` batch or a padded
        :class:`~detr_irpe.structures.ImageBatch` (each image cut to its own size) ->
        ``{"pred_logits", "pred_boxes"}`` of the batch; each image runs on its own (boxes
        normalised by its own size, as every family's are). ``targets`` are not read."""
        if isinstance(images, ImageBatch):
            batch = [image[:, :h, :w] for image, (h, w) in zip(images.tensors,
                                                                images.image_sizes)]
        else:
            batch = list(images)
        logits, boxes = [], []
        for image in batch:
            one = image.unsqueeze(0).float()
            out = self._run(one)
            if not self.checked:
                self._check(one, out)
            logits.append(out[0])
            boxes.append(out[1])
        device = batch[0].device if batch else torch.device("cpu")
        return {"pred_logits": torch.cat(logits).to(device),
                "pred_boxes": torch.cat(boxes).to(device)}

    def eval(self) -> OnnxRuntimeModel:  # called like a module
        return self


def build_runtime(name: str, model: nn.Module, *, device: torch.device | str = "cpu",
                  cache_dir: str | Path | None = None) -> Callable[..., Any]:
    """The callable that runs ``model``'s inference in runtime ``name`` (:data:`RUNTIMES`).

    Raises:
        ConfigError: an unknown runtime, or ``onnxruntime`` without the extra or not on the
            CPU.
    """
    if name not in RUNTIMES:
        raise ConfigError(f"unknown runtime {name!r}; choose one of {', '.join(RUNTIMES)}")
    if name == "pytorch":
        return model.eval()
    if name == "fused":
        return inference_form(model, device)
    if name == "compiled":
        return CompiledModel(model, device)
    if torch.device(device).type != "cpu":
        raise ConfigError("runtime onnxruntime runs on the CPU; use --device cpu, or "
                          "--runtime fused on a GPU")
    return OnnxRuntimeModel(model, cache_dir)
