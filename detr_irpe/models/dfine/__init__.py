"""D-FINE (Peng et al., "D-FINE: Redefine Regression Task of DETRs as Fine-grained
Distribution Refinement", ICLR 2025) and DEIM (Huang et al., "DEIM: DETR with Improved
Matching for Fast Convergence", CVPR 2025): one family, ``model.family: dfine``, with
optional iRPE / RoPE in the AIFI encoder layer.

DEIM trains D-FINE's network (SiLU instead of ReLU in the decoder: ``model.variant``)
with another loss (``loss.classification: mal``), augmentation and schedule.

One folder: the HGNetv2 backbone from timm (:mod:`.hgnetv2`; RT-DETR's ResNet-vd also
fits), the hybrid encoder (RT-DETR's, with D-FINE's fusion blocks: :mod:`.encoder`), the
decoder (:mod:`.decoder`, :mod:`.deformable`) with Fine-grained Distribution Refinement
(:mod:`.distribution`), the criterion (:mod:`.criterion`, :mod:`.losses`,
:mod:`.matching`, :mod:`.loss_config`), the model config (:mod:`.config`), the builder
(:mod:`.build`) and the published files' keys (:mod:`.keys`, :mod:`.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from detr_irpe.family import AttentionSupport, DetectorFamily, register_family
from detr_irpe.models.dfine.build import build_detector, build_postprocessor
from detr_irpe.models.dfine.checkpoint import CHECKPOINT
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.dfine.criterion import DFINECriterion, build_criterion
from detr_irpe.models.dfine.export import onnx_wrapper
from detr_irpe.models.dfine.hf import HF
from detr_irpe.models.dfine.loss_config import DFINELossConfig
from detr_irpe.models.dfine.model import DFINE
from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.models.rtdetr.decoder import selected_queries
from detr_irpe.models.rtdetr.model import encoder_attention
from detr_irpe.resize import SquareRule


def build(model_cfg: DFINEModelConfig, loss_cfg: DFINELossConfig,
          load_backbone_weights: bool = True, categories: Iterable[int] | None = None, *,
          load_weights: bool | None = None, category_ids: Sequence[int] | None = None
          ) -> tuple[DFINE, DFINECriterion, TopKPostProcess]:
    """``(model, criterion, postprocessor)`` of the configs."""
    load = load_backbone_weights if load_weights is None else load_weights
    model = build_detector(model_cfg, load)
    return (model, build_criterion(model_cfg, loss_cfg),
            build_postprocessor(model_cfg, categories, category_ids))


FAMILY = register_family(DetectorFamily(
    name="dfine",
    title="D-FINE",
    model_config=DFINEModelConfig,
    loss_config=DFINELossConfig,
    build=build,
    build_detector=build_detector,
    build_postprocessor=build_postprocessor,
    model_types=(DFINE,),
    describe=lambda m: m.title,
    checkpoint=CHECKPOINT,
    hf=HF,
    onnx_wrapper=onnx_wrapper,
    sigmoid_classes=True,
    selected_queries=selected_queries,
    figures=("selected-queries", "distributions"),
    benchmark_targets={"D-FINE": "dfine_l"},
    attention=AttentionSupport(
        encoder=encoder_attention, grid_stride=DFINE.STRIDE,
        no_decoder_figure="D-FINE's decoder cross-attention is deformable (a few sampled "
                          "points per query and level), it has no dense map"),
    resize_rule=SquareRule.from_data,
))

__all__ = ["DFINE", "FAMILY", "DFINELossConfig", "DFINEModelConfig", "build"]
