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

from detr_irpe.models.dfine.build import build_detector, build_postprocessor
from detr_irpe.models.dfine.checkpoint import CHECKPOINT
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.dfine.criterion import build_criterion
from detr_irpe.models.dfine.export import onnx_wrapper
from detr_irpe.models.dfine.hf import HF
from detr_irpe.models.dfine.loss_config import DFINELossConfig
from detr_irpe.models.dfine.model import DFINE
from detr_irpe.models.hybrid.family import build_of, register_query_selection_family

build = build_of(build_detector, build_criterion, build_postprocessor)

FAMILY = register_query_selection_family(
    DFINE, name="dfine", title="D-FINE", model_config=DFINEModelConfig,
    loss_config=DFINELossConfig, build=build, build_detector=build_detector,
    build_postprocessor=build_postprocessor, describe=lambda m: m.title,
    checkpoint=CHECKPOINT, hf=HF, onnx_wrapper=onnx_wrapper,
    figures=("selected-queries", "distributions"), benchmark_targets={"D-FINE": "dfine_l"})

__all__ = ["DFINE", "FAMILY", "DFINELossConfig", "DFINEModelConfig", "build"]
