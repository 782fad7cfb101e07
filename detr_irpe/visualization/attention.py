"""Capture the attention weights of a DETR forward pass without touching the model's code.

:func:`capture_attention` registers forward pre-hooks (``with_kwargs=True``) on the
attention modules the model's family names (:class:`detr_irpe.family.AttentionSupport`):
the encoder layers' self-attention (DETR's encoder, RT-DETR's AIFI layer) and the decoder
layers' dense cross-attention (DETR's ``multihead_attn``; DAB-DETR / DN-DETR's
``cross_attn``, weights from its ``attention_weights``; RT-DETR's deformable
cross-attention has no dense map and is not captured). The hooks only record the
inputs of each call during one ``torch.no_grad()`` forward; afterwards the weights are
recomputed from those inputs (``need_weights=True``; ``attention_logits`` for the split of
the encoder logits into content and iRPE terms). The hooks are removed when the capture
ends (a context manager), so the model costs nothing extra when nothing is captured, and
the forward pass itself runs exactly the training / evaluation code path.

Token order is DETR's: the ``H x W`` feature map flattened row-major, ``t = row * W + col``
(docs/irpe.md section 1); :func:`pixel_to_token` maps image pixels to tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from detr_irpe.errors import ConfigError
from detr_irpe.family import AttentionSupport, family_of_model
from detr_irpe.structures import ImageBatch

logger = logging.getLogger(__name__)

__all__ = [
    "model_device",
    "AttentionRecord",
    "InputRecorder",
    "capture_attention",
    "record_attention_inputs",
    "pixel_to_token",
    "token_to_cell",
    "attention_support",
    "encoder_attention_modules",
    "decoder_attention_modules",
]


# --------------------------------------------------------------------------- token geometry


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters are (its inputs go there); the CPU for a model without."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def pixel_to_token(
    x: float, y: float, image_size: tuple[int, int], grid_size: tuple[int, int]
) -> int:
    """The token of the feature cell that holds pixel ``(x, y)``.

    The ``H x W`` grid covers the ``h x w`` image evenly (cell ``(r, c)`` spans rows
    ``[r h / H, (r + 1) h / H)``), as DETR's nearest-neighbour downsampling of the padding
    mask assumes; pass the padded input size and the full feature grid.

    Args:
        x, y: pixel coordinates (column, row), ``0 <= x < w``, ``0 <= y < h``.
        image_size: ``(h, w)``.
        grid_size: ``(H, W)``.

    Returns:
        ``row * W + col`` with ``row = floor(y H / h)``, ``col = floor(x W / w)``,
        clamped to the grid.
    """
    height, width = image_size
    rows, cols = grid_size
    if not (0 <= x <= width and 0 <= y <= height):
        raise ConfigError(f"point ({x}, {y}) is outside the {width}x{height} (w x h) image")
    row = min(int(y * rows / height), rows - 1)
    col = min(int(x * cols / width), cols - 1)
    return row * cols + col


def token_to_cell(token: int, grid_size: tuple[int, int]) -> tuple[int, int]:
    """``(row, col)`` of a row-major token."""
    return divmod(int(token), int(grid_size[1]))


# --------------------------------------------------------------------------- modules


def attention_support(model: nn.Module) -> AttentionSupport:
    """Where the attention modules of ``model`` are (its family's ``attention``).

    Raises:
        ConfigError: the model's family registers none (or the model is of no family).
    """
    family = family_of_model(model)
    if family is None or family.attention is None:
        who = (f"{family.title} (model.family={family.name})" if family is not None
               else type(getattr(model, "module", model)).__name__)
        raise ConfigError(f"{who} has no attention figures: its family registers no "
                          "attention modules (DetectorFamily.attention)")
    return family.attention


def encoder_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The encoder self-attention modules of ``model``, in layer order (DETR's encoder
    layers' ``self_attn``, RT-DETR's AIFI layer)."""
    return list(attention_support(model).encoder(getattr(model, "module", model)))


def decoder_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The dense cross-attention of every decoder layer: ``multihead_attn`` (DETR) or
    ``cross_attn`` (the dab decoder's conditional cross-attention, DAB-DETR / DN-DETR);
    [] for a decoder without dense maps (RT-DETR's deformable attention)."""
    return list(attention_support(model).decoder(getattr(model, "module", model)))


def _select(count: int, layers: Iterable[int] | str | None) -> list[int]:
    """Layer indices (negative counts from the end); ``"all"``/None = all, ``"none"``/[] = none."""
    if layers is None or layers == "all":
        return list(range(count))
    if layers == "none":
        return []
    chosen = []
    for index in layers:
        if not -count <= int(index) < count:
            raise ConfigError(f"layer {index} does not exist; the model has {count} layers")
        chosen.append(int(index) % count)
    return sorted(set(chosen))


# --------------------------------------------------------------------------- recording


def _detached_copy(value: Any, memo: dict[int, Tensor]) -> Any:
    """Clone tensors (keeping aliasing: the encoder passes the same tensor as q and k)."""
    if isinstance(value, Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.detach().clone()
        return memo[id(value)]
    if isinstance(value, tuple):
        return tuple(_detached_copy(v, memo) for v in value)
    if isinstance(value, list):
        return [_detached_copy(v, memo) for v in value]
    return value


class InputRecorder:
    """Forward pre-hooks that store the (cloned) inputs of the last call of each module.

    Use as a context manager; the hooks are removed on exit, also on errors.
    ``calls[name]`` is a ``(module, bound arguments)`` pair where the arguments are the
    module's ``forward`` parameters by name.
    """

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.calls: dict[str, tuple[nn.Module, dict[str, Any]]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            if name in self.calls:
                logger.warning("%s was called more than once in the forward; keeping the last",
                               name)
            self.calls[name] = (module, _detached_copy(dict(bound.arguments), {}))
            return None

        return hook

    def __enter__(self) -> InputRecorder:
        for name, module in self.modules.items():
            self._handles.append(
                module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextlib.contextmanager
def record_attention_inputs(
    model: nn.Module,
    encoder_layers: Iterable[int] | str | None = "all",
    decoder_layers: Iterable[int] | str | None = "all",
) -> Iterator[InputRecorder]:
    """Hooks on the chosen encoder ``self_attn`` / decoder ``multihead_attn`` modules.

    Names in ``recorder.calls`` are ``"encoder.{i}"`` and ``"decoder.{i}"``, plus
    ``"transformer"`` (its inputs give the feature grid and padding mask).
    """
    modules: dict[str, nn.Module] = {}
    if isinstance(getattr(model, "transformer", None), nn.Module):
        modules["transformer"] = model.transformer
    encoders = encoder_attention_modules(model)
    for i in _select(len(encoders), encoder_layers):
        modules[f"encoder.{i}"] = encoders[i]
    decoders = decoder_attention_modules(model)
    for i in _select(len(decoders), decoder_layers):
        modules[f"decoder.{i}"] = decoders[i]
    with InputRecorder(modules) as recorder:
        yield recorder


# --------------------------------------------------------------------------- the record


@dataclass
class AttentionRecord:
    """Attention of one forward pass over a batch.

    Attributes:
        outputs: the model's outputs (``pred_logits``, ``pred_boxes``, ``aux_outputs``).
        hw: ``(H, W)`` of the (padded) feature map; ``L = H * W``.
        padding: ``(B, H, W)`` bool, True where the feature cell is padding.
        input_size: ``(h, w)`` of the padded input batch.
        image_sizes: the un-padded ``(h, w)`` of every input image.
        encoder: ``{layer: (B, heads, L, L)}`` softmax weights (rows sum to 1 over the
            non-padded keys; padded keys are 0).
        encoder_content: ``{layer: (B, heads, L, L)}`` content logits ``s q . k``
            (only with ``rpe_split``).
        encoder_rpe: ``{layer: (B, heads, L, L)}`` iRPE logits (RPE-Q + RPE-K terms;
            only with ``rpe_split``).
        decoder: ``{layer: (B, heads, Q, L)}`` cross-attention weights of the object queries
            over the encoder memory (DETR's, or the dab decoder's conditional
            cross-attention; its ``outputs`` then also hold ``anchors``).
        num_encoder_layers, num_decoder_layers: depths of the model (layer -1 = the last).
    """

    outputs: dict[str, Any]
    hw: tuple[int, int]
    padding: Tensor
    input_size: tuple[int, int]
    image_sizes: list[tuple[int, int]]
    encoder: dict[int, Tensor] = field(default_factory=dict)
    encoder_content: dict[int, Tensor] = field(default_factory=dict)
    encoder_rpe: dict[int, Tensor] = field(default_factory=dict)
    decoder: dict[int, Tensor] = field(default_factory=dict)
    num_encoder_layers: int = 0
    num_decoder_layers: int = 0

    @property
    def key_padding_mask(self) -> Tensor:
        """``(B, L)`` bool, True = padded key."""
        return self.padding.flatten(1)

    def token(self, x: float, y: float, batch_index: int = 0,
              scale: tuple[float, float] = (1.0, 1.0)) -> int:
        """Token of a pixel ``(x, y)`` given in coordinates ``scale = (sy, sx)`` times the
        model input's (e.g. original-image pixels: ``sy = h0 / h``)."""
        h, w = self.image_sizes[batch_index]
        x_in, y_in = x / scale[1], y / scale[0]
        if not (0 <= x_in <= w and 0 <= y_in <= h):
            raise ConfigError(f"point ({x}, {y}) is outside the image")
        return pixel_to_token(x_in, y_in, self.input_size, self.hw)

    def encoder_maps(self, layer: int, token: int, batch_index: int = 0,
                     what: str = "weights") -> Tensor:
        """``(heads, H, W)`` attention of query ``token`` over the grid.

        ``what``: ``"weights"`` (softmax with iRPE, the model's attention), ``"content"``
        (softmax of the content logits alone: the attention without iRPE),
        ``"rpe_logits"`` (the iRPE logits; 0 on padding) or ``"difference"``
        (weights - content softmax).
        """
        layer = self.layer_index("encoder", layer)
        if what == "weights":
            row = self.encoder[layer][batch_index, :, token]
        elif what in ("content", "rpe_logits", "difference"):
            if layer not in self.encoder_content:
                raise ValueError("the iRPE split was not captured; use rpe_split=True")
            pad = self.key_padding_mask[batch_index]
            if what == "rpe_logits":
                row = self.encoder_rpe[layer][batch_index, :, token].masked_fill(pad, 0.0)
            else:
                content = self.encoder_content[layer][batch_index, :, token]
                row = _masked_softmax(content, pad)
                if what == "difference":
                    row = self.encoder[layer][batch_index, :, token] - row
        else:
            raise ValueError(f"unknown map {what!r}; choose weights, content, rpe_logits, "
                             "difference")
        return row.reshape(row.shape[0], *self.hw)

    def decoder_maps(self, query: int, layer: int = -1, batch_index: int = 0) -> Tensor:
        """``(heads, H, W)`` cross-attention of object query ``query`` over the grid."""
        layer = self.layer_index("decoder", layer)
        row = self.decoder[layer][batch_index, :, query]
        return row.reshape(row.shape[0], *self.hw)

    def layer_index(self, kind: str, layer: int) -> int:
        """The captured ``"encoder"`` / ``"decoder"`` layer ``layer`` (negative: counted from
        the model's last layer); a clear error when it was not captured."""
        store = self.encoder if kind == "encoder" else self.decoder
        count = self.num_encoder_layers if kind == "encoder" else self.num_decoder_layers
        if not store:
            raise ValueError(f"no {kind} attention was captured")
        if layer < 0:  # counted from the end of the model, not of the captured subset
            layer += count or (max(store) + 1)
        if layer not in store:
            raise ValueError(f"{kind} layer {layer} was not captured; captured: {sorted(store)}")
        return layer


def _masked_softmax(logits: Tensor, pad: Tensor) -> Tensor:
    """Softmax over the last dim ignoring ``pad`` (True) entries; ``pad`` broadcasts."""
    return torch.softmax(logits.float().masked_fill(pad, float("-inf")), dim=-1)


# --------------------------------------------------------------------------- capture


def _as_batch(images: ImageBatch | Sequence[Tensor] | Tensor) -> ImageBatch:
    if isinstance(images, ImageBatch):
        return images
    if isinstance(images, Tensor):
        if images.dim() == 3:
            images = [images]
        elif images.dim() == 4:
            images = list(images)
        else:
            raise ValueError(f"images must be (3, H, W) or (B, 3, H, W), got {tuple(images.shape)}")
    return ImageBatch.from_images(list(images))


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def capture_attention(
    model: nn.Module,
    images: ImageBatch | Sequence[Tensor] | Tensor,
    encoder_layers: Iterable[int] | str | None = "all",
    decoder_layers: Iterable[int] | str | None = "all",
    rpe_split: bool = False,
) -> AttentionRecord:
    """One eval-mode forward pass, recording the attention of the chosen layers.

    Args:
        model: a DETR from :func:`detr_irpe.build_model` (put in eval mode for the pass;
            its mode is restored afterwards).
        images: an :class:`ImageBatch`, a list of ``(3, H, W)`` normalised images or a
            ``(B, 3, H, W)`` tensor, on the model's device.
        encoder_layers, decoder_layers: layer indices (negative from the end), ``"all"``
            or ``"none"``.
        rpe_split: also record the encoder's content and iRPE logits (``attention_logits``).

    Returns:
        an :class:`AttentionRecord` (tensors on the CPU, float32).
    """
    batch = _as_batch(images)
    with _eval_mode(model), record_attention_inputs(model, encoder_layers,
                                                    decoder_layers) as recorder:
        outputs = model(batch)
    record = _recompute(recorder.calls, outputs, batch, rpe_split,
                        attention_support(model).grid_stride)
    record.num_encoder_layers = len(encoder_attention_modules(model))
    record.num_decoder_layers = len(decoder_attention_modules(model))
    return record


def _recompute(calls: dict[str, tuple[nn.Module, dict[str, Any]]], outputs: dict[str, Any],
               batch: ImageBatch, rpe_split: bool, grid_stride: int | None = None
               ) -> AttentionRecord:
    hw = None
    padding_flat = None
    encoder, content, rpe, decoder = {}, {}, {}, {}
    grid_mask = None
    for name, (module, arguments) in sorted(calls.items()):
        if name == "transformer":
            grid_mask = arguments.get("mask")  # (B, H, W), True = pad
            continue
        kind, index = name.split(".")
        layer = int(index)
        if kind == "encoder":
            arguments = dict(arguments, need_weights=True)
            layer_hw = tuple(int(v) for v in arguments["hw"])
            if hw is not None and layer_hw != hw:
                raise RuntimeError(f"encoder layers saw different grids {hw} and {layer_hw}")
            hw = layer_hw
            padding_flat = arguments.get("key_padding_mask")
            with _eval_mode(module):
                _, weights = module(**arguments)
                encoder[layer] = weights.float().cpu()
                if rpe_split:
                    if not hasattr(module, "attention_logits"):
                        raise ValueError(f"{type(module).__name__} has no attention_logits; "
                                         "the iRPE split needs MultiheadAttention")
                    c, r = module.attention_logits(
                        arguments["query"], arguments["key"], arguments["hw"],
                        key_padding_mask=arguments.get("key_padding_mask"),
                    )
                    content[layer] = c.float().cpu()
                    rpe[layer] = r.float().cpu()
        else:
            if padding_flat is None:
                padding_flat = arguments.get("key_padding_mask")
            decoder[layer] = _decoder_weights(module, arguments).float().cpu()
    input_size = tuple(int(v) for v in batch.tensors.shape[-2:])
    if grid_stride is not None and hw is not None:
        # the model padded its input to the grid's stride itself: the grid covers that
        input_size = (hw[0] * grid_stride, hw[1] * grid_stride)
    b = batch.tensors.shape[0]
    if grid_mask is not None and grid_mask.dim() == 3:
        hw = hw or (int(grid_mask.shape[1]), int(grid_mask.shape[2]))
        padding = grid_mask.bool().cpu()
    else:
        if hw is None:
            hw = _grid_from_decoder(decoder, batch)
        padding = (torch.zeros(b, *hw, dtype=torch.bool) if padding_flat is None
                   else padding_flat.bool().cpu().reshape(b, *hw))
    return AttentionRecord(
        outputs=outputs, hw=hw, padding=padding, input_size=input_size,
        image_sizes=[tuple(int(v) for v in s) for s in batch.image_sizes],
        encoder=encoder, encoder_content=content, encoder_rpe=rpe, decoder=decoder,
    )


def _decoder_weights(module: nn.Module, arguments: dict[str, Any]) -> Tensor:
    """``(B, heads, Q, L)`` cross-attention weights of one recorded decoder call."""
    if hasattr(module, "attention_weights"):
        # the dab decoder's attention of already projected (content, position) pairs
        return module.attention_weights(
            arguments["q"], arguments["k"], key_padding_mask=arguments.get("key_padding_mask"),
            attn_mask=arguments.get("attn_mask"))
    # nn.MultiheadAttention: per-head weights, not the head average
    arguments = dict(arguments, need_weights=True, average_attn_weights=False)
    with _eval_mode(module):
        return module(**arguments)[1]


def _grid_from_decoder(decoder: dict[int, Tensor], batch: ImageBatch) -> tuple[int, int]:
    """The grid when no encoder layer was captured: from the memory length and the
    backbone's stride (the input size divided by 32, rounded up, or 16 for DC5)."""
    if not decoder:
        raise ValueError("nothing was captured: choose at least one encoder or decoder layer")
    length = next(iter(decoder.values())).shape[-1]
    height, width = batch.tensors.shape[-2:]
    for stride in (32, 16, 8):
        grid = (-(-height // stride), -(-width // stride))
        if grid[0] * grid[1] == length:
            return grid
    raise ValueError(
        f"cannot infer the feature grid of {length} tokens for a {height}x{width} input; "
        "capture at least one encoder layer"
    )
