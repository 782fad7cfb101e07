"""A DEIMv2 Hugging Face folder read back takes the shipped config of its size: a folder
holds the model, not the recipe, and the recipe it goes on top of is the one a published
file of the same backbone implies (``deimv2_atto`` .. ``deimv2_n``, ``deimv2_s`` ..
``deimv2_x``), not DEIMv2-S's. So an Atto folder evaluates and predicts at Atto's 320 px,
Femto's at 416, and trains with its own size's losses and schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from helpers import config_hf_folder  # noqa: E402

from detr_irpe.checkpoint import read_checkpoint  # noqa: E402
from detr_irpe.checkpoint.saved_config import resolve_config  # noqa: E402
from detr_irpe.config import load_config  # noqa: E402
from detr_irpe.inference import Predictor  # noqa: E402
from detr_irpe.models import model_from_checkpoint  # noqa: E402


# (config, its eval size): the published recipes' 320 / 416 / 640; M stands for the ViT
# sizes, whose recipes differ from S's in schedule and losses, not in size
@pytest.mark.parametrize(("name", "eval_size"), [("deimv2_atto", 320), ("deimv2_femto", 416),
                                                 ("deimv2_n", 640), ("deimv2_m", 640)])
def test_a_folder_reads_back_into_its_size_s_recipe(name: str, eval_size: int,
                                                    tmp_path: Path) -> None:
    folder = config_hf_folder(name, tmp_path / "hf")
    back = model_from_checkpoint(folder)
    shipped = load_config(name).to_dict()
    assert back.cfg.data.eval_size == eval_size
    values = back.cfg.to_dict()
    for section in ("data", "loss", "train"):
        assert values[section] == shipped[section], section
    assert back.cfg.model.size == shipped["model"]["size"]


def test_the_tools_use_the_size_s_eval_size(tmp_path: Path) -> None:
    """What predict / eval read: the resolved config (convert's path) and the Predictor's
    input of an Atto folder, 320 x 320."""
    folder = config_hf_folder("deimv2_atto", tmp_path / "hf")
    state, meta = read_checkpoint(folder)
    cfg = resolve_config(folder, None, (), meta, state)
    assert (cfg.data.train_size, cfg.data.eval_size) == (320, 320)
    assert cfg.loss.local_losses is False and cfg.train.epochs == 500
    predictor = Predictor.from_checkpoint(folder, device="cpu")
    image = torch.zeros(3, 480, 640, dtype=torch.uint8)
    assert tuple(predictor.preprocess(image).shape) == (3, 320, 320)


def test_a_folder_of_other_widths_keeps_its_backbone_s_recipe(tmp_path: Path) -> None:
    """Settings of no published size (Atto's backbone, 50 queries, width 32): the HGNetv2's
    stages still say Atto, so the data and training sections are Atto's, the model the
    folder's."""
    folder = config_hf_folder("deimv2_atto", tmp_path / "hf",
                     ("model.num_queries=50", "model.hidden_dim=32", "model.enc_hidden_dim=32"))
    back = model_from_checkpoint(folder)
    assert back.cfg.model.size is None
    assert (back.cfg.model.num_queries, back.cfg.model.hidden_dim) == (50, 32)
    assert back.cfg.data.eval_size == 320
    assert back.cfg.to_dict()["train"] == load_config("deimv2_atto").to_dict()["train"]
