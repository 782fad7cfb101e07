"""RT-DETR, the real-time DETR (Zhao et al., CVPR 2024), as the published ``rtdetrv2_pytorch``
code builds its v1 models, with optional iRPE in the AIFI encoder layer.

One folder: ResNet-vd backbone (:mod:`.presnet`), hybrid encoder (:mod:`.hybrid_encoder`),
decoder with query selection (:mod:`.decoder`, :mod:`.deformable`), contrastive
denoising (:mod:`.denoising`), the VFL criterion (:mod:`.criterion`), the config
(:mod:`.config`), the builder (:mod:`.build`) and the published files' keys (:mod:`.keys`).
"""

from detr_irpe.family import DetectorFamily, register_family
from detr_irpe.models.rtdetr.build import build, build_detector, build_postprocessor
from detr_irpe.models.rtdetr.checkpoint import CHECKPOINT
from detr_irpe.models.rtdetr.config import RTDETRLossConfig, RTDETRModelConfig
from detr_irpe.models.rtdetr.hf import HF
from detr_irpe.models.rtdetr.model import RTDETR

FAMILY = register_family(DetectorFamily(
    name="rtdetr",
    title="RT-DETR",
    model_config=RTDETRModelConfig,
    loss_config=RTDETRLossConfig,
    build=build,
    build_detector=build_detector,
    build_postprocessor=build_postprocessor,
    model_types=(RTDETR,),
    describe=lambda m: f"RT-DETR-R{m.depth}",
    checkpoint=CHECKPOINT,
    hf=HF,
    sigmoid_classes=True,
    benchmark_targets={"RT-DETR": "rtdetr_r50"},
))

__all__ = ["FAMILY", "RTDETR", "RTDETRLossConfig", "RTDETRModelConfig"]
