"""Reading image files safely: one reader for training, evaluation, prediction and figures.

:func:`read_image` first reads only the file's header (PIL parses the format and
the declared width and height without decoding pixels) and refuses an image
declaring more than ``max_pixels`` pixels: a file of a few hundred kilobytes can
declare a 30000 x 30000 image whose decoding takes gigabytes and tens of seconds.
Only then are the pixels decoded, by ``torchvision.io`` when it has the decoders
(fast for JPEG, PNG, GIF, WebP) and by PIL otherwise. A torchvision release
without ``torchvision.io.read_file`` / ``decode_image`` only loses the fast path.

Every failure (missing file, not an image, too large, truncated, corrupt) raises
:class:`~detr_irpe.errors.ImageReadError` naming the file and the reason.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor

from detr_irpe.errors import ImageReadError

logger = logging.getLogger(__name__)

# PIL's own warning threshold (1024**3 // 4 // 3), about a 9459 x 9459 image: far above
# any detection dataset's photographs, and about 270 MB once decoded to RGB.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

# torchvision 0.29 deprecates its image decoders (for TorchCodec) with a warning on every
# call; they are still the fast path here, so that one message is kept out of the logs.
_TV_DEPRECATION = "The image decoding and encoding capabilities of TorchVision"


def _torchvision_decoders() -> tuple[Any, Any, Any] | None:
    """``(read_file, decode_image, ImageReadMode)`` of ``torchvision.io``, or None when
    this torchvision lacks one of them (looked up per call, so nothing fails at import)."""
    try:
        # torchvision's decoders are a fast path, not a requirement: a build without
        # them reads with PIL (and a failing import must not break the package's)
        import torchvision.io as tvio
    except ImportError:
        return None
    parts = tuple(getattr(tvio, name, None) for name in ("read_file", "decode_image",
                                                         "ImageReadMode"))
    return None if any(part is None for part in parts) else parts


def image_size(path: str | Path) -> tuple[int, int]:
    """``(width, height)`` declared by the file's header, without decoding the pixels.

    Raises :class:`ImageReadError` for a missing file, one that is not an image, or
    one beyond PIL's own hard limit (twice ``PIL.Image.MAX_IMAGE_PIXELS``), which PIL
    refuses to open at all.
    """
    path = Path(path)
    if not path.is_file():
        raise ImageReadError(f"cannot read image {path}: no such file")
    try:
        with warnings.catch_warnings():
            # Our own limit is checked by the caller; PIL's warning would only add noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as pil:
                return int(pil.width), int(pil.height)
    except Image.DecompressionBombError:
        raise ImageReadError(
            f"image {path} declares more than {2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels "
            f"(PIL's hard limit, above any data.max_image_pixels); refused without decoding"
        ) from None
    except Exception as err:  # PIL raises several unrelated types for non-image files
        raise ImageReadError(f"cannot read image {path}: not a readable image ({err})") from None


def check_pixel_count(path: str | Path, max_pixels: int | None) -> tuple[int, int]:
    """``(width, height)`` from the header; :class:`ImageReadError` above ``max_pixels``."""
    width, height = image_size(path)
    if max_pixels is not None and width * height > max_pixels:
        raise ImageReadError(
            f"image {path} declares {width} x {height} = {width * height:,} pixels, more than "
            f"data.max_image_pixels = {max_pixels:,}; refused without decoding (raise the "
            f"limit if the image is genuine)"
        )
    return width, height


def _decode_pil(path: Path, apply_exif: bool) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # size checked before
        with Image.open(path) as pil:
            if apply_exif:
                pil = ImageOps.exif_transpose(pil)
            pil = pil.convert("RGB")
            array = torch.frombuffer(bytearray(pil.tobytes()), dtype=torch.uint8)
            return array.view(pil.height, pil.width, 3).permute(2, 0, 1).contiguous()


def _decode_torchvision(path: Path, apply_exif: bool) -> tuple[Tensor | None, Exception | None]:
    """The decoded image, or ``(None, reason)`` when torchvision cannot (PIL decides then)."""
    decoders = _torchvision_decoders()
    if decoders is None:
        return None, None
    read_file, decode_image, mode = decoders
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TV_DEPRECATION, category=DeprecationWarning)
        try:
            data = read_file(str(path))
        except (OSError, RuntimeError) as err:
            raise ImageReadError(f"cannot read image {path}: {err}") from None
        try:
            image = decode_image(data, mode=mode.RGB, apply_exif_orientation=apply_exif)
        except RuntimeError as err:
            return None, err
    return image, None


def read_image(
    path: str | Path, apply_exif: bool = True, max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
) -> Tensor:
    """Decode an image file to a uint8 RGB tensor ``(3, H, W)``.

    The header is checked first: an image declaring more than ``max_pixels``
    pixels (None: no limit beyond PIL's own) is refused before any decoding.
    Grayscale, palette, alpha and 16-bit images are converted to 8-bit RGB; EXIF
    orientation is applied when ``apply_exif``; of an animated image (GIF, WebP) the first
    frame is read (with a warning). Raises :class:`ImageReadError`
    for a missing, non-image, too large, truncated or corrupt file.
    """
    path = Path(path)
    check_pixel_count(path, max_pixels)
    image, tv_err = _decode_torchvision(path, apply_exif)
    if image is None:
        # Unsupported by torchvision.io (BMP, TIFF, ...), no decoder, or corrupt: PIL decides.
        try:
            image = _decode_pil(path, apply_exif)
        except Exception as pil_err:  # PIL raises several unrelated types for bad files
            reason = f"{tv_err}; PIL: {pil_err}" if tv_err is not None else str(pil_err)
            raise ImageReadError(f"cannot decode image {path}: {reason}") from None
    if image.dim() == 4:  # torchvision decodes every frame of an animated GIF / WebP
        logger.warning("image %s has %d frames: its first is used", path, image.shape[0])
        image = image[0]
    if image.dtype != torch.uint8:  # 16-bit PNG
        image = (image.float() * (255.0 / 65535.0)).round().to(torch.uint8)
    return image


# Float images may stray this far outside [0, 1] (resampling overshoot) and still be accepted.
_FLOAT_TOLERANCE = 1e-3


def to_uint8_image(
    image: str | Path | Image.Image | np.ndarray | Tensor, max_pixels: int | None = None
) -> Tensor:
    """Any accepted image kind -> a ``(3, H, W)`` uint8 RGB tensor on the CPU.

    Float tensors in ``[0, 1]`` are scaled by 255 and rounded: the model was trained
    on 8-bit images, and this makes a float copy of an 8-bit image give exactly the
    same detections. Paths go through :func:`read_image`
    (``max_pixels`` checked before decoding).
    """
    if isinstance(image, (str, Path)):
        return read_image(image, max_pixels=max_pixels)
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(
                f"a NumPy image must be (H, W, 3) uint8 RGB, got shape {image.shape} "
                f"dtype {image.dtype}"
            )
        # A copy: the caller's array stays theirs (and PIL's arrays are read-only).
        return torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1).contiguous()
    if not isinstance(image, Tensor):
        raise TypeError(
            f"unsupported image type {type(image).__name__}: pass a path, a PIL image, an "
            f"(H, W, 3) uint8 array or a (3, H, W) tensor"
        )
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"an image tensor must be (3, H, W), got shape {tuple(image.shape)}")
    image = image.detach().cpu()
    if image.dtype == torch.uint8:
        return image
    if not image.is_floating_point():
        raise ValueError(f"an image tensor must be uint8 or float in [0, 1], got {image.dtype}")
    low, high = float(image.min()), float(image.max())
    if low < -_FLOAT_TOLERANCE or high > 1.0 + _FLOAT_TOLERANCE:
        raise ValueError(
            f"a float image tensor must hold values in [0, 1], got [{low:.3g}, {high:.3g}] "
            f"(an ImageNet-normalised tensor is not accepted: pass the image itself)"
        )
    return (image.float() * 255.0).round().clamp(0, 255).to(torch.uint8)


__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "check_pixel_count",
    "image_size",
    "read_image",
    "to_uint8_image",
]
