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
  ``fused`` form: the same outputs either way, to float32 rounding. A DETR / DAB-DETR /
  DN-DETR list of images is padded into its :class:`~detr_irpe.structures.ImageBatch`
  before the compiled code (the padding copy, compiled, made Inductor's mkldnn
  convolution fusion fail). Inductor's on-disk caches go to ``$DETR_IRPE_CACHE/inductor``
  (unless ``TORCHINDUCTOR_CACHE_DIR`` is set); torch's own log lines and warnings while
  compiling go to logging at DEBUG (:mod:`detr_irpe.utils.torch_logs`), not the console.
- ``onnxruntime``: the model exported to ONNX with a dynamic size, traced at a size the
  model holds (RT-DETR / D-FINE: its square evaluation size, 640 as published; the
  others: 64 x 64), cached in a folder (:func:`runtime_cache_dir`) under a key of
  everything that shapes the graph (weights and buffers, the model's structure and
  settings, the trace size and dynamic axes, the versions of the package, torch, onnx and
  onnxscript) with a JSON sidecar holding the key and the graph's SHA-256; checked once
  against PyTorch on the first input (queries paired as sets; a refusal says when
  PyTorch's own float32 outputs are as far from float64: :mod:`.precision`), and run by
  ONNX Runtime on the CPU (the ``onnx`` extra). A cached graph that is unreadable, of another key or not the one its sidecar
  names is exported again; a cache folder that cannot be written gives one warning and a
  graph kept in memory for the run. One image per call (the exported graph reads no
  padding mask); the outputs are ``pred_logits`` and ``pred_boxes``, post-processed
  exactly as PyTorch's.

:func:`build_runtime` returns a callable ``images -> outputs`` with the model's own
input forms (a list of ``(3, H, W)`` tensors or a batch) and its outputs dict.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from detr_irpe.errors import ConfigError, DetrIrpeError
from detr_irpe.export.onnx import (
    IMAGE_INPUT,
    MIN_OPSET,
    ImagesToPredictions,
    export_onnx,
    onnx_wrapper,
)
from detr_irpe.inference.precision import float32_error, ill_conditioned_note
from detr_irpe.models.fusion import inference_form
from detr_irpe.resize import resize_rule
from detr_irpe.structures import ImageBatch
from detr_irpe.utils.files import atomic_write, atomic_write_text, describe_os_error
from detr_irpe.utils.torch_logs import torch_logs_to_debug

logger = logging.getLogger(__name__)

__all__ = ["RUNTIMES", "CompiledModel", "OnnxRuntimeModel", "build_runtime", "cache_root",
           "compile_frozen", "compiler_problem", "default_trace_size", "graph_key",
           "inductor_cache_dir", "runtime_cache_dir", "trace_size_for"]

RUNTIMES = ("pytorch", "fused", "compiled", "onnxruntime")
# largest |ONNX Runtime - PyTorch| of the first call's outputs that is float32 rounding
CHECK_ATOL = 1e-3
# the first-call check compares queries as sets (a top-k over near-tied scores orders
# them differently); at most this share of them may find no partner (a near-tie at the
# k-th proposal swaps one proposal for another)
CHECK_UNMATCHED_SHARE = 0.02
# the trace size of a graph whose sides are multiples of a stride (RT-DETR / D-FINE) when
# the caller names none: the published square evaluation size
PUBLISHED_EVAL_SIDE = 640
# the trace size of the other families' graphs (any side above the stride serves)
SMALL_TRACE = (64, 64)
# bumped when the layout of the cache (key, sidecar) changes
CACHE_FORMAT = 2


def cache_root() -> Path:
    """The package's cache folder: ``$DETR_IRPE_CACHE`` (default ``~/.cache/detr_irpe``)."""
    return Path(os.environ.get("DETR_IRPE_CACHE") or Path.home() / ".cache" / "detr_irpe")


def runtime_cache_dir() -> Path:
    """Where exported graphs are kept: ``$DETR_IRPE_CACHE/onnx`` (default
    ``~/.cache/detr_irpe/onnx``)."""
    return cache_root() / "onnx"


def inductor_cache_dir() -> Path:
    """Where the compiled runtime keeps Inductor's on-disk caches (FX graphs, kernels):
    ``$DETR_IRPE_CACHE/inductor``."""
    return cache_root() / "inductor"


def _unusable_folder(folder: Path) -> str | None:
    """Why files cannot be created in ``folder`` (made when missing), or None."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return describe_os_error(err)
    return None


def _digest_tensors(digest: Any, named: Any) -> None:
    for name, tensor in named:
        digest.update(name.encode())
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
                      .numpy().tobytes())


def _weights_digest(model: nn.Module) -> str:
    """A digest of every parameter and buffer (non-persistent ones included)."""
    digest = hashlib.sha256()
    _digest_tensors(digest, model.named_parameters())
    _digest_tensors(digest, model.named_buffers())
    return digest.hexdigest()


_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> Any:
    """``value`` as JSON data when it is a setting (a number, a string, a tuple of them, a
    function's name), else None (tensors, caches and other objects are not settings)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list, torch.Size)):
        items = [_plain(v) for v in value]
        return items if all(i is not None or v is None for i, v in zip(items, value)) else None
    if isinstance(value, torch.dtype):
        return str(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return None


def _structure(model: nn.Module) -> list:
    """The model as built: each module's name, class and plain settings (``num_queries``,
    ``eval_idx``, strides, ...): what shapes a graph beyond the tensors."""
    out = []
    for name, module in model.named_modules():
        settings = {}
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or key == "training":
                continue
            plain = _plain(value)
            if plain is not None or value is None:
                settings[key] = plain
        out.append([name, f"{type(module).__module__}.{type(module).__qualname__}", settings])
    return out


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe_dim(dim: Any) -> str:
    root = getattr(dim, "root", None)
    text = f"{dim!r}[{getattr(dim, 'min', None)},{getattr(dim, 'max', None)}]"
    return text if root is None else f"{text} of {_describe_dim(root)}"


def graph_key(model: nn.Module, trace_size: tuple[int, int]) -> dict[str, Any]:
    """Everything that shapes ``model``'s ONNX graph, as JSON data: the cache key of
    :class:`OnnxRuntimeModel` (a graph is found again only when all of it is equal)."""
    wrapper = onnx_wrapper(model)
    axes = {str(axis): _describe_dim(dim)
            for axis, dim in wrapper.dynamic_shapes(IMAGE_INPUT)[IMAGE_INPUT].items()}
    structure = json.dumps(_structure(model), sort_keys=True, default=str)
    return {
        "format": CACHE_FORMAT,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "wrapper": type(wrapper).__qualname__,
        "weights": _weights_digest(model),
        "structure": hashlib.sha256(structure.encode()).hexdigest(),
        "trace_size": list(trace_size),
        "dynamic_axes": axes,
        "opset": MIN_OPSET,
        "versions": {"detr_irpe": _version("detr_irpe"), "torch": torch.__version__,
                     "onnx": _version("onnx"), "onnxscript": _version("onnxscript")},
    }


def _key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _pads_to_stride(wrapper: nn.Module) -> bool:
    """A graph whose sides must be multiples of its stride (RT-DETR's, D-FINE's)."""
    return hasattr(wrapper, "padding_value")


def default_trace_size(model: nn.Module) -> tuple[int, int]:
    """The trace size of ``model``'s graph when the caller knows no evaluation size:
    RT-DETR / D-FINE (a top-k over the encoder's proposals: a small input has too few)
    at the published :data:`PUBLISHED_EVAL_SIDE`, the others at :data:`SMALL_TRACE`."""
    if _pads_to_stride(onnx_wrapper(model)):
        return PUBLISHED_EVAL_SIDE, PUBLISHED_EVAL_SIDE
    return SMALL_TRACE


def trace_size_for(cfg: Any) -> tuple[int, int] | None:
    """The trace size a config evaluates at, where its resize rule makes that one size
    (RT-DETR's: ``data.eval_size`` squared); None otherwise (DETR's evaluation keeps each
    image's aspect ratio: :func:`default_trace_size`) and for no config."""
    if getattr(cfg, "data", None) is None:
        return None
    return resize_rule(cfg).eval_shape


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


def _use_inductor_cache_dir() -> None:
    """Point Inductor's on-disk caches at :func:`inductor_cache_dir` unless the user chose
    a folder (``TORCHINDUCTOR_CACHE_DIR``; torch writes its default there once it has
    looked); a folder that cannot be written leaves torch's default."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return
    folder = inductor_cache_dir()
    problem = _unusable_folder(folder)
    if problem is not None:
        logger.warning("runtime compiled: the cache folder %s cannot be written (%s); "
                       "Inductor keeps its cache in %s", folder, problem, default_cache_dir())
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def compile_frozen(module: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(module)`` for inference, with Inductor's freezing on while it
    compiles (the weights become constants of the graph: folded, prepacked for the CPU's
    convolution and matrix kernels). Freezing is set around each call because compilation
    happens at the first call of each input shape; passed as
    ``options={"freezing": True}`` it did not take effect (D-FINE-L at 640 on 2 cores ran
    at 394 ms that way against 327 ms, Intel Xeon AMX, 2026-12-04). Torch's log lines and
    warnings of each call (dynamo's graph-break notes, Inductor's) go to logging at DEBUG."""
    compiled = torch.compile(module, dynamic=False)

    def run(*args: Any, **kwargs: Any) -> Any:
        from torch._inductor import config as inductor_config  # noqa: PLC0415 (torch's)

        with inductor_config.patch(freezing=True), torch_logs_to_debug():
            return compiled(*args, **kwargs)

    return run


class CompiledModel:
    """A detector's inference form compiled by ``torch.compile`` (Inductor, weights frozen
    into the graph), called like the model in eval mode; the ``fused`` form where the
    compiler cannot run (a warning names why, once).

    A list of images for a model that takes an :class:`~detr_irpe.structures.ImageBatch`
    (DETR, DAB-DETR / DN-DETR) is padded into one before the compiled code runs: compiled,
    the padding copy (a scatter) feeding the first convolution made Inductor's mkldnn
    convolution fusion fail on the CPU (``FakeTensorUpdater cannot recompute metadata``),
    and the compiled runtime fell back to ``fused`` for those families.

    Args:
        model: the detector (eval mode).
        device: where it runs.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = inference_form(model, device)
        self.fallback_reason = compiler_problem(device)
        self._compiled = None
        # DETR and the dab family read an ImageBatch; RT-DETR / D-FINE pad by themselves
        self.batches_images = isinstance(onnx_wrapper(self.model), ImagesToPredictions)
        if self.fallback_reason is None:
            _use_inductor_cache_dir()
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
        if (args and self.batches_images and isinstance(args[0], (list, tuple))
                and args[0] and all(isinstance(x, Tensor) for x in args[0])):
            args = (ImageBatch.from_images(list(args[0])), *args[1:])
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
            logger.debug("torch.compile failed", exc_info=True)
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


def _import_onnxruntime() -> Any:
    """``onnxruntime``, or a one-line :class:`ConfigError` (missing, or its import fails:
    a broken install raises anything from ImportError to OSError)."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise ConfigError("runtime onnxruntime needs the onnx extra: pip install "
                          "'detr_irpe[onnx]'")
    try:
        import onnxruntime  # optional (the onnx extra): checked for just above
    except Exception as err:  # noqa: BLE001 (whatever a broken install raises)
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        raise ConfigError(f"runtime onnxruntime: importing onnxruntime failed "
                          f"({type(err).__name__}: {first}); reinstall the onnx extra "
                          "(pip install 'detr_irpe[onnx]') or use --runtime fused") from None
    return onnxruntime


def _first_line(err: BaseException) -> str:
    text = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {text[:300]}"


def _matched_difference(got: Tensor, want: Tensor) -> tuple[float, int]:
    """``got`` and ``want`` ``(Q, D)`` (one row per query: logits and box) compared as sets:
    the largest difference of a row from its nearest row of the other (one to one), and how
    many rows found no partner within :data:`CHECK_ATOL`."""
    if got.shape != want.shape:
        return float("inf"), got.shape[0]
    dist = torch.cdist(got.double(), want.double(), p=float("inf"))
    nearest, partner = dist.min(1)
    close = nearest <= CHECK_ATOL
    # rows without a partner, and rows sharing one (the matching must be one to one)
    unmatched = int((~close).sum()) + int(close.sum()) - len(set(partner[close].tolist()))
    matched = nearest[close]
    return (float(matched.max()) if matched.numel() else float("inf")), unmatched


class OnnxRuntimeModel:
    """A detector run by ONNX Runtime, called like the model in eval mode.

    Args:
        model: the detector (eval mode); exported on construction unless its graph is in
            the cache under its key (:func:`graph_key`).
        cache_dir: the cache folder (default :func:`runtime_cache_dir`).
        threads: ONNX Runtime's intra-op threads (default: torch's).
        trace_size: ``(H, W)`` the graph is traced at (it stays dynamic in both); a size
            the model holds: the config's evaluation size (:func:`trace_size_for`), default
            :func:`default_trace_size`. RT-DETR / D-FINE sides are rounded up to a multiple
            of 32 (the model pads to one itself).

    Raises:
        ConfigError: onnxruntime missing or not importable.
        ExportError: the model cannot be exported at ``trace_size`` (one line; the
            exporter's own lines go to logging at DEBUG).
    """

    def __init__(self, model: nn.Module, cache_dir: str | Path | None = None,
                 threads: int | None = None, trace_size: tuple[int, int] | None = None
                 ) -> None:
        self._ort = _import_onnxruntime()
        self.model = model.eval()
        self._wrapper = onnx_wrapper(self.model)
        size = tuple(int(s) for s in (trace_size or default_trace_size(self.model)))
        stride = getattr(self._wrapper, "stride", None)
        if _pads_to_stride(self._wrapper) and stride:
            size = tuple(max(2 * stride, -(-s // stride) * stride) for s in size)
        self.trace_size: tuple[int, int] = size  # type: ignore[assignment]
        self.threads = threads or torch.get_num_threads()
        self.key = graph_key(self.model, self.trace_size)
        digest = _key_digest(self.key)
        folder = Path(cache_dir) if cache_dir is not None else runtime_cache_dir()
        stem = f"{type(model).__name__.lower()}_{digest[:24]}"
        self.path = folder / f"{stem}.onnx"
        self.sidecar = folder / f"{stem}.json"
        self._digest = digest
        self.session = self._cached_session()
        if self.session is None:
            self.session = self._session(self._export(folder))
        self._input = self.session.get_inputs()[0].name
        self.checked = False

    # ------------------------------------------------------------------ the cache
    def _session(self, data: bytes) -> Any:
        options = self._ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        return self._ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])

    def _cached_session(self) -> Any:
        """The cached graph's session, or None (nothing there, or a graph not to trust:
        a warning says why, and the graph is exported again)."""
        if not self.path.exists() and not self.sidecar.exists():
            return None
        try:
            problem, data = self._read_cached()
        except OSError as err:
            problem, data = f"cannot be read ({describe_os_error(err)})", None
        if problem is None:
            try:
                session = self._session(data)
            except Exception as err:  # noqa: BLE001 (onnxruntime's own error types)
                problem = f"does not load in ONNX Runtime ({_first_line(err)})"
            else:
                logger.info("ONNX Runtime graph from the cache: %s", self.path)
                return session
        logger.warning("runtime onnxruntime: the cached graph %s %s; exporting the model "
                       "again", self.path, problem)
        return None

    def _read_cached(self) -> tuple[str | None, bytes | None]:
        """(why the cached graph is not this model's, None) or (None, its bytes)."""
        if not self.sidecar.is_file():
            return f"has no sidecar {self.sidecar.name} naming its key", None
        if self.sidecar.stat().st_size > 1 << 20:
            return f"has a sidecar {self.sidecar.name} that is not one", None
        try:
            meta = json.loads(self.sidecar.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"has an unreadable sidecar {self.sidecar.name}", None
        if not isinstance(meta, dict) or meta.get("key") != self.key:
            return "was made from another model or settings (its sidecar's key differs)", None
        if not self.path.is_file():
            return "is missing", None
        size = self.path.stat().st_size
        if size != meta.get("graph_bytes"):
            return (f"has {size} bytes where its sidecar says {meta.get('graph_bytes')} "
                    "(cut short or replaced)"), None
        data = self.path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta.get("graph_sha256"):
            return "is not the graph its sidecar names (another SHA-256)", None
        return None, data

    def _export(self, folder: Path) -> bytes:
        """Export the model (in a temporary folder), then store the graph and its sidecar
        in ``folder`` atomically; a folder that cannot be written gives one warning and
        the graph serves this run only."""
        logger.info("exporting the model for ONNX Runtime at %dx%d (dynamic height and "
                    "width; once per model and settings)", *self.trace_size)
        with tempfile.TemporaryDirectory(prefix="detr_irpe_onnx_") as tmp:
            graph = Path(tmp) / self.path.name
            export_onnx(self.model, graph, self.trace_size, dynamic=True)
            data = graph.read_bytes()
        problem = _unusable_folder(folder)
        if problem is None:
            meta = {"key": self.key, "key_sha256": self._digest, "graph_bytes": len(data),
                    "graph_sha256": hashlib.sha256(data).hexdigest()}
            try:
                atomic_write(self.path, lambda f: f.write(data))
                atomic_write_text(self.sidecar, json.dumps(meta, indent=1) + "\n")
            except DetrIrpeError as err:
                problem = str(err)
        if problem is not None:
            logger.warning("runtime onnxruntime: the cache folder %s cannot be written "
                           "(%s); the exported graph serves this run only", folder, problem)
        else:
            logger.info("ONNX Runtime graph cached in %s", self.path)
        return data

    def _forget(self) -> None:
        """Remove the cached graph and its sidecar (a graph that failed its check)."""
        for path in (self.sidecar, self.path):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    # ------------------------------------------------------------------ running
    def _run(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """The graph on ``images``; a graph made for sides that are multiples of a stride
        (RT-DETR's: 32) gets the images padded at the bottom / right to one, and its boxes
        are rescaled to the unpadded image, as the PyTorch model does itself."""
        height, width = images.shape[-2:]
        # a graph whose sides must be multiples of its stride says how to pad to one
        stride = self._wrapper.stride if _pads_to_stride(self._wrapper) else None
        pad_h, pad_w = (-height % stride, -width % stride) if stride else (0, 0)
        if pad_h or pad_w:
            value = self._wrapper.padding_value().to(images.dtype).view(1, 3, 1, 1)
            padded = value.expand(images.shape[0], 3, height + pad_h, width + pad_w).clone()
            padded[..., :height, :width] = images
            images = padded
        try:
            logits, boxes = self.session.run(None, {self._input: images.detach().cpu()
                                                    .numpy()})
        except Exception as err:  # noqa: BLE001 (onnxruntime's own error types)
            raise DetrIrpeError(
                f"ONNX Runtime could not run {self.path.name} on a {images.shape[-2]}x"
                f"{images.shape[-1]} input ({_first_line(err)}); use --runtime fused"
            ) from None
        logits, boxes = torch.from_numpy(logits), torch.from_numpy(boxes)
        if pad_h or pad_w:
            scale = torch.tensor([(width + pad_w) / width, (height + pad_h) / height] * 2)
            boxes = boxes * scale
        return logits, boxes

    def _check(self, images: Tensor, got: tuple[Tensor, Tensor]) -> None:
        """The first call's outputs against PyTorch's, each image's queries as a set (the
        top-k of RT-DETR / D-FINE orders near-tied proposals either way)."""
        with torch.no_grad():
            want = self._wrapper(images)
        worst, unmatched = 0.0, 0
        for i in range(images.shape[0]):
            rows = torch.cat([got[0][i], got[1][i]], -1)
            ref = torch.cat([want[0][i].cpu(), want[1][i].cpu()], -1)
            diff, missing = _matched_difference(rows, ref)
            worst, unmatched = max(worst, diff), max(unmatched, missing)
        allowed = int(CHECK_UNMATCHED_SHARE * got[0].shape[1])
        if unmatched > allowed or not worst <= CHECK_ATOL:
            self._forget()
            # PyTorch's own float32 error on this input: where it is as large, the weights
            # (not the graph) are what no other order of sums can reproduce
            note = ill_conditioned_note(float32_error(self._wrapper, images, want))
            raise DetrIrpeError(
                f"ONNX Runtime's outputs differ from PyTorch's for {self.path} ({unmatched} "
                f"of {got[0].shape[1]} queries without a partner within {CHECK_ATOL:g}); the "
                "graph was not used and is removed from the cache: run again to export it "
                f"again, or use --runtime pytorch{note}")
        logger.info("ONNX Runtime checked against PyTorch: largest difference %.1e "
                    "(queries compared as sets)", worst)
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
                  cache_dir: str | Path | None = None,
                  trace_size: tuple[int, int] | None = None) -> Callable[..., Any]:
    """The callable that runs ``model``'s inference in runtime ``name`` (:data:`RUNTIMES`).
    ``trace_size``: the ONNX graph's trace size (:class:`OnnxRuntimeModel`).

    Raises:
        ConfigError: an unknown runtime, or ``onnxruntime`` without the extra (or not
            importable) or not on the CPU.
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
    return OnnxRuntimeModel(model, cache_dir, trace_size=trace_size)
