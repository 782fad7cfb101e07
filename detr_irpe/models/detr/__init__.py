"""The DETR family (Carion et al., ECCV 2020) with iRPE in the encoder (Wu et al., ICCV
2021): ``model.family: detr``.

- ``config.py``: its ``model`` / ``loss`` sections (and the keys DAB-DETR shares);
- ``model.py``: :class:`DETR` (backbone -> transformer -> class and box heads);
- ``transformer.py``: the encoder (iRPE attention) and decoder;
- ``criterion.py``: :class:`SetCriterion` (Hungarian matching, CE + L1 + GIoU);
- ``build.py``: config -> (model, criterion, post-processor);
- ``checkpoint.py``: its state-dict layouts; ``hf.py``: Hugging Face ``DetrForObjectDetection``.

Importing this package registers the family (:mod:`detr_irpe.family`).
"""

from detr_irpe.family import AttentionSupport, DetectorFamily, register_family
from detr_irpe.models.detr.build import build, build_detector, build_postprocessor
from detr_irpe.models.detr.checkpoint import CHECKPOINT
from detr_irpe.models.detr.config import DETRLossConfig, DETRModelConfig
from detr_irpe.models.detr.criterion import SetCriterion
from detr_irpe.models.detr.hf import HF
from detr_irpe.models.detr.model import DETR, decoder_attention, encoder_attention
from detr_irpe.models.detr.transformer import Transformer
from detr_irpe.resize import ShorterSideRule

FAMILY = register_family(DetectorFamily(
    name="detr",
    title="DETR",
    model_config=DETRModelConfig,
    loss_config=DETRLossConfig,
    build=build,
    build_detector=build_detector,
    build_postprocessor=build_postprocessor,
    model_types=(DETR,),
    checkpoint=CHECKPOINT,
    hf=HF,
    benchmark_targets={"DETR": "detr_r50"},
    attention=AttentionSupport(encoder=encoder_attention, decoder=decoder_attention),
    resize_rule=ShorterSideRule.from_data,
))

__all__ = ["DETR", "FAMILY", "DETRLossConfig", "DETRModelConfig", "SetCriterion", "Transformer"]
