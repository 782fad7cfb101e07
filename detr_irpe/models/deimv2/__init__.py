"""DEIMv2 (Intellindust-AI-Lab/DEIMv2, "Real-Time Object Detection Meets DINOv3"): its own
family, ``model.family: deimv2``, sizes S, M, L, X (the ViT backbones) and Atto, Femto,
Pico, N (HGNetv2 backbones: :mod:`detr_irpe.models.hgnetv2`; the lite encoder for
Atto-Pico).

Why a family of its own and not a ``variant`` of ``dfine``: its backbone (a ViT with
RoPE-DINOv3 and the spatial tuning adapter), its encoder blocks and its decoder layers
differ from D-FINE's, so its model section, key layout and checkpoint recognition do; what
it shares with D-FINE / DEIM it imports from :mod:`detr_irpe.models.dfine` (FDR, the
deformable attention, the LQE, the criterion with DEIM's MAL, the post-processor, the
ONNX wrapper) and from :mod:`detr_irpe.models.hybrid` (query selection, denoising).

The modules: the ViTs (:mod:`.backbone`), the adapter (:mod:`.sta`) and the backbone as
the detector holds it (:mod:`.vit_sta`), the encoder's blocks (:mod:`.encoder_blocks`),
the decoder's layers (:mod:`.decoder_layers`) and decoder (:mod:`.decoder`), the model
(:mod:`.model`), its config (:mod:`.config`) and builder (:mod:`.build`), the loss section
and criterion (:mod:`.loss_config`, :mod:`.criterion`, :mod:`.matching`: the matcher
switch), the published files' keys (:mod:`.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from detr_irpe.family import AttentionSupport, DetectorFamily, register_family
from detr_irpe.models.deimv2.build import build_detector, build_postprocessor
from detr_irpe.models.deimv2.checkpoint import CHECKPOINT
from detr_irpe.models.deimv2.config import DEIMv2ModelConfig
from detr_irpe.models.deimv2.criterion import build_criterion
from detr_irpe.models.deimv2.hf import HF
from detr_irpe.models.deimv2.loss_config import DEIMv2LossConfig
from detr_irpe.models.deimv2.model import DEIMv2
from detr_irpe.models.dfine.criterion import DFINECriterion
from detr_irpe.models.dfine.export import onnx_wrapper
from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.models.rtdetr.decoder import selected_queries
from detr_irpe.models.rtdetr.model import encoder_attention
from detr_irpe.resize import SquareRule


def _encoder_attention(model: DEIMv2) -> list:
    """The AIFI layers' self-attention of the hybrid encoder; none in the lite encoder
    (Atto-Pico), which has no attention."""
    return encoder_attention(model) if hasattr(model.encoder, "encoder") else []


def build(model_cfg: DEIMv2ModelConfig, loss_cfg: DEIMv2LossConfig,
          load_backbone_weights: bool = True, categories: Iterable[int] | None = None, *,
          load_weights: bool | None = None, category_ids: Sequence[int] | None = None
          ) -> tuple[DEIMv2, DFINECriterion, TopKPostProcess]:
    """``(model, criterion, postprocessor)`` of the configs."""
    load = load_backbone_weights if load_weights is None else load_weights
    model = build_detector(model_cfg, load)
    return (model, build_criterion(model_cfg, loss_cfg),
            build_postprocessor(model_cfg, categories, category_ids))


FAMILY = register_family(DetectorFamily(
    name="deimv2",
    title="DEIMv2",
    model_config=DEIMv2ModelConfig,
    loss_config=DEIMv2LossConfig,
    build=build,
    build_detector=build_detector,
    build_postprocessor=build_postprocessor,
    model_types=(DEIMv2,),
    describe=lambda m: m.title,
    checkpoint=CHECKPOINT,
    hf=HF,
    onnx_wrapper=onnx_wrapper,
    sigmoid_classes=True,
    selected_queries=selected_queries,
    figures=("selected-queries", "distributions"),
    benchmark_targets={"DEIMv2": "deimv2_s"},
    attention=AttentionSupport(
        encoder=_encoder_attention, grid_stride=DEIMv2.STRIDE,
        no_decoder_figure="DEIMv2's decoder cross-attention is deformable (a few sampled "
                          "points per query and level), it has no dense map"),
    resize_rule=SquareRule.from_data,
))

__all__ = ["DEIMv2", "DEIMv2LossConfig", "DEIMv2ModelConfig", "FAMILY", "build"]
