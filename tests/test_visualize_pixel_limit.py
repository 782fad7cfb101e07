"""The figure tools read image files under the config's pixel limit (data.max_image_pixels),
like training, evaluation and prediction do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.errors import EXIT_USER_ERROR, ImageReadError
from detr_irpe.visualization import prepare_image


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
    small = ["model.num_classes=3", "model.enc_layers=1", "model.dec_layers=1"]
    status = visualize_main([*common, "--set", *small, "data.max_image_pixels=1000"])
    err = capsys.readouterr().err
    assert status == EXIT_USER_ERROR
    assert "photo.png" in err and "data.max_image_pixels = 1,000" in err
    assert not (tmp_path / "fig.png").exists()
    # Under the limit the same command draws the figure.
    assert visualize_main([*common, "--set", *small, "data.max_image_pixels=1200"]) == 0
    assert (tmp_path / "fig.png").is_file()
