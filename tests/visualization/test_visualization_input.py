"""The figure tools see an image as prediction does: files read under the config's pixel
limit (data.max_image_pixels), and the same model input as the Predictor's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as F
from PIL import Image

from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.data.inputs import prepare_image
from detr_irpe.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from detr_irpe.errors import EXIT_USER_ERROR, ImageReadError


def _png(path: Path, height: int = 30, width: int = 40) -> Path:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def test_prepare_image_refuses_a_file_over_the_limit_it_is_given(tmp_path: Path) -> None:
    image = _png(tmp_path / "photo.png")  # 40 x 30 = 1200 pixels
    assert prepare_image(image, size=None, max_pixels=1200).original_size == (30, 40)
    with pytest.raises(ImageReadError, match="1,200 pixels.*data.max_image_pixels = 1,199"):
        prepare_image(image, size=None, max_pixels=1199)


def test_visualize_cli_applies_data_max_image_pixels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = _png(tmp_path / "photo.png")
    common = ["predictions", "--config", "synthetic_tiny", "--image", str(image),
              "--device", "cpu", "--out", str(tmp_path / "fig.png")]
    small = ["model.num_classes=3"]
    status = visualize_main([*common, "--set", *small, "data.max_image_pixels=1000"])
    err = capsys.readouterr().err
    assert status == EXIT_USER_ERROR
    assert "photo.png" in err and "data.max_image_pixels = 1,000" in err
    assert not (tmp_path / "fig.png").exists()
    # Under the limit the same command draws the figure.
    assert visualize_main([*common, "--set", *small, "data.max_image_pixels=1200"]) == 0
    assert (tmp_path / "fig.png").is_file()


def _naive_eval_input(pixels: torch.Tensor, size: int, max_size: int) -> torch.Tensor:
    """The evaluation input written out: 8-bit pixels, shorter side ``size`` unless the
    longer side would pass ``max_size`` (then rounded), antialiased resize, /255, ImageNet."""
    height, width = pixels.shape[-2:]
    short, long = min(height, width), max(height, width)
    if long / short * size > max_size:
        size = int(round(max_size * short / long))
    if short != size:
        other = int(size * long / short)
        height, width = (size, other) if height <= width else (other, size)
        pixels = F.resize(pixels, [height, width], antialias=True)
    image01 = pixels.float() / 255.0
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (image01 - mean) / std


@pytest.mark.parametrize("kind", ["uint8", "float", "array", "normalized"])
def test_prepare_image_gives_the_evaluation_input_of_the_8_bit_image(kind: str) -> None:
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (3, 45, 70), dtype=torch.uint8, generator=generator)
    given = {
        "uint8": pixels,
        # a float image off the 1/255 grid: read as the 8-bit image it rounds to
        "float": ((pixels.float() + 0.8 * (torch.rand(pixels.shape, generator=generator) - 0.5))
                  / 255.0).clamp(0.0, 1.0),
        "array": pixels.permute(1, 2, 0).numpy(),
        "normalized": _naive_eval_input(pixels, size=45, max_size=1000),
    }[kind]
    prepared = prepare_image(given, size=32, max_size=40, normalized=kind == "normalized")
    assert np.array_equal(prepared.display, pixels.permute(1, 2, 0).numpy())
    torch.testing.assert_close(prepared.tensor, _naive_eval_input(pixels, 32, 40),
                               atol=1e-6, rtol=0)
    # 45 x 70 with size 32 would make the longer side 49 > 40: shorter side round(25.7) = 26
    assert prepared.input_size == (26, 40)
