"""``--to hf`` for every shipped config (issue 42, defect 1): the model each config builds
(its shipped settings, random weights, a 3-class head), and the same without its
relative / rotary encodings (what ``--rpe none`` writes), is either written as a folder
that transformers loads with no missing, unexpected or mismatched key and that reads back
into the same weights, or refused in one line naming the setting transformers has no
place for. A folder transformers cannot load is never written. (The outputs of written
folders against transformers' are compared per family in test_hf_checkpoint.py,
tests/models/dab and tests/models/rtdetr.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")

from detr_irpe.checkpoint.hf_folder import write_hf_folder  # noqa: E402
from detr_irpe.config import CONFIG_DIR, load_config  # noqa: E402
from detr_irpe.errors import CheckpointError  # noqa: E402
from detr_irpe.models import build_model, model_from_checkpoint  # noqa: E402

CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
# the transformers class of each family that has one
HF_CLASSES = {"detr": "DetrForObjectDetection", "dab": "DabDetrForObjectDetection",
              "rtdetr": "RTDetrForObjectDetection", "dfine": "DFineForObjectDetection",
              "deimv2": "Deimv2ForObjectDetection"}
# what each refusal names: a model with an encoding transformers lacks, DN-DETR's
# label_enc, a family without a transformers writer, fewer backbone stages
# the configs whose model transformers holds as shipped; with the encodings dropped
# (--rpe none) also their iRPE versions
WRITTEN = {"detr_r50", "dab_detr_r50", "rtdetr_r18", "rtdetr_r34", "rtdetr_r50", "rtdetr_r101",
           "dfine_n", "dfine_s", "dfine_m", "dfine_l", "dfine_x",
           "deimv2_s", "deimv2_m", "deimv2_l", "deimv2_x", "deimv2_tiny", "synthetic_demo_deimv2",
           "deimv2_atto", "deimv2_femto", "deimv2_pico", "deimv2_n"}
WRITTEN_PLAIN = WRITTEN | {"detr_r50_irpe", "detr_r50_irpe_1.9", "detr_r50_irpe_300e",
                           "dab_detr_r50_irpe", "rtdetr_r18_irpe", "rtdetr_r50_irpe",
                           "dfine_s_irpe", "dfine_l_irpe", "dfine_s_rope", "dfine_l_rope",
                           "dfine_tiny", "synthetic_demo_dfine"}
REFUSALS = ("variant", "iRPE", "RoPE", "rpe", "rope", "label_enc", "denoising",
            "backbone_stages", "depth_mult", "Hugging Face", "transformers")


@pytest.mark.slow
@pytest.mark.parametrize("plain", [False, True], ids=["shipped", "rpe-none"])
@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_converts_to_a_folder_transformers_loads_or_is_refused(
        name: str, plain: bool, tmp_path: Path) -> None:
    overrides = ["model.num_classes=3"]
    if plain:
        overrides += ["model.rpe=none", "model.rope=none"]
    cfg = load_config(name, overrides)
    torch.manual_seed(0)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    out = tmp_path / "hf"
    expected = name in (WRITTEN_PLAIN if plain else WRITTEN)
    try:
        write_hf_folder(model.state_dict(), cfg, out)
    except CheckpointError as err:
        message = str(err)
        assert "\n" not in message and any(word in message for word in REFUSALS), message
        assert not out.exists() and not expected, message
        return
    assert expected, f"{name} was written; add it to WRITTEN after checking it"
    hf_class = getattr(transformers, HF_CLASSES[cfg.model.family])
    loaded, info = hf_class.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    # and this package reads the folder back into the same model
    back = model_from_checkpoint(out)
    assert back.cfg.model.family == cfg.model.family
    mine = model.state_dict()
    assert all(torch.equal(back.model.state_dict()[k], v) for k, v in mine.items())

