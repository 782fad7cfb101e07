"""RT-DETR, the real-time DETR (Zhao et al., CVPR 2024), as the published ``rtdetrv2_pytorch``
code builds its v1 models, with optional iRPE in the AIFI encoder layer.

One folder: ResNet-vd backbone (:mod:`.presnet`), hybrid encoder (:mod:`.hybrid_encoder`),
decoder with query selection (:mod:`.decoder`, :mod:`.deformable`; the parts it shares
with D-FINE in :mod:`detr_irpe.models.hybrid`), the VFL criterion (:mod:`.criterion`), the config
(:mod:`.config`), the builder (:mod:`.build`) and the published files' keys (:mod:`.keys`).
"""

from detr_irpe.models.hybrid.family import register_query_selection_family
from detr_irpe.models.rtdetr.build import build, build_detector, build_postprocessor
from detr_irpe.models.rtdetr.checkpoint import CHECKPOINT
from detr_irpe.models.rtdetr.config import RTDETRLossConfig, RTDETRModelConfig
from detr_irpe.models.rtdetr.export import onnx_wrapper
from detr_irpe.models.rtdetr.hf import HF
from detr_irpe.models.rtdetr.model import RTDETR


def _describe(model_cfg: RTDETRModelConfig) -> str:
    """``RT-DETR-R50``, ``RT-DETR-HGNetv2-L``, ``RT-DETR-<backbone>``."""
    if model_cfg.backbone == "presnet":
        return f"RT-DETR-R{model_cfg.depth}"
    if model_cfg.backbone.startswith("hgnetv2_"):
        return f"RT-DETR-HGNetv2-{model_cfg.backbone.removeprefix('hgnetv2_').upper()}"
    return f"RT-DETR-{model_cfg.backbone}"


FAMILY = register_query_selection_family(
    RTDETR, name="rtdetr", title="RT-DETR", model_config=RTDETRModelConfig,
    loss_config=RTDETRLossConfig, build=build, build_detector=build_detector,
    build_postprocessor=build_postprocessor, describe=_describe, checkpoint=CHECKPOINT,
    hf=HF, onnx_wrapper=onnx_wrapper, figures=("selected-queries",),
    benchmark_targets={"RT-DETR": "rtdetr_r50"})

__all__ = ["FAMILY", "RTDETR", "RTDETRLossConfig", "RTDETRModelConfig"]
