"""RT-DETR, the real-time DETR (Zhao et al., CVPR 2024), as the published ``rtdetrv2_pytorch``
code builds its v1 models, with optional iRPE in the AIFI encoder layer.

One folder: ResNet-vd backbone (:mod:`.presnet`), hybrid encoder (:mod:`.hybrid_encoder`),
decoder with query selection (:mod:`.decoder`, :mod:`.deformable`; the parts it shares
with D-FINE in :mod:`detr_irpe.models.hybrid`), the VFL criterion (:mod:`.criterion`), the config
(:mod:`.config`), the builder (:mod:`.build`) and the published files' keys (:mod:`.keys`).
"""

from detr_irpe.family import AttentionSupport, DetectorFamily, register_family
from detr_irpe.models.rtdetr.build import build, build_detector, build_postprocessor
from detr_irpe.models.rtdetr.checkpoint import CHECKPOINT
from detr_irpe.models.rtdetr.config import RTDETRLossConfig, RTDETRModelConfig
from detr_irpe.models.rtdetr.decoder import selected_queries
from detr_irpe.models.rtdetr.export import onnx_wrapper
from detr_irpe.models.rtdetr.hf import HF
from detr_irpe.models.rtdetr.model import RTDETR, encoder_attention
from detr_irpe.resize import SquareRule

FAMILY = register_family(DetectorFamily(
    name="rtdetr",
    title="RT-DETR",
    model_config=RTDETRModelConfig,
    loss_config=RTDETRLossConfig,
    build=build,
    build_detector=build_detector,
    build_postprocessor=build_postprocessor,
    model_types=(RTDETR,),
    describe=lambda m: (f"RT-DETR-R{m.depth}" if m.backbone == "presnet"
                        else f"RT-DETR-HGNetv2-{m.backbone.removeprefix('hgnetv2_').upper()}"
                        if m.backbone.startswith("hgnetv2_") else f"RT-DETR-{m.backbone}"),
    checkpoint=CHECKPOINT,
    hf=HF,
    onnx_wrapper=onnx_wrapper,
    sigmoid_classes=True,
    selected_queries=selected_queries,
    figures=("selected-queries",),
    benchmark_targets={"RT-DETR": "rtdetr_r50"},
    attention=AttentionSupport(
        encoder=encoder_attention, grid_stride=RTDETR.STRIDE,
        no_decoder_figure="RT-DETR's decoder cross-attention is deformable (a few sampled "
                          "points per query and level), it has no dense map"),
    resize_rule=SquareRule.from_data,
))

__all__ = ["FAMILY", "RTDETR", "RTDETRLossConfig", "RTDETRModelConfig"]
