"""The DAB-DETR family (Liu et al., ICLR 2022; DN-DETR, Li et al., CVPR 2022, with
``model.denoising.enabled``): ``model.family: dab``. It reuses DETR's backbone and
encoder layers (:mod:`detr_irpe.models.detr`).

- ``config.py``: its ``model`` / ``loss`` sections; ``model.py``: :class:`DABDETR`;
- ``transformer.py``: anchor queries, conditional cross-attention, box refinement;
- ``denoising.py``: DN-DETR's noised queries; ``criterion.py``: focal loss + denoising;
- ``build.py``; ``checkpoint.py`` / ``implied_config.py``: IDEA-Research's files;
  ``hf_keys.py`` / ``hf.py``: Hugging Face ``DabDetrForObjectDetection``.

Importing this package registers the family (:mod:`detr_irpe.family`).
"""

from detr_irpe.family import AttentionSupport, DetectorFamily, register_family
from detr_irpe.models.dab.build import build, build_detector, build_postprocessor, describe
from detr_irpe.models.dab.checkpoint import CHECKPOINT
from detr_irpe.models.dab.config import DABLossConfig, DABModelConfig, DenoisingConfig
from detr_irpe.models.dab.hf import HF
from detr_irpe.models.dab.model import DABDETR, decoder_attention
from detr_irpe.models.detr.model import encoder_attention
from detr_irpe.resize import ShorterSideRule

FAMILY = register_family(DetectorFamily(
    name="dab",
    title="DAB-DETR",
    model_config=DABModelConfig,
    loss_config=DABLossConfig,
    build=build,
    build_detector=build_detector,
    build_postprocessor=build_postprocessor,
    model_types=(DABDETR,),
    describe=describe,
    checkpoint=CHECKPOINT,
    hf=HF,
    sigmoid_classes=True,
    figures=("anchors", "anchor-attention"),
    benchmark_targets={"DAB-DETR": "dab_detr_r50", "DN-DETR": "dn_detr_r50"},
    attention=AttentionSupport(encoder=encoder_attention, decoder=decoder_attention),
    resize_rule=ShorterSideRule.from_data,
))

__all__ = ["DABDETR", "FAMILY", "DABLossConfig", "DABModelConfig", "DenoisingConfig"]
