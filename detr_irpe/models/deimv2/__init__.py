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

from detr_irpe.models.deimv2.build import build_detector, build_postprocessor
from detr_irpe.models.deimv2.checkpoint import CHECKPOINT
from detr_irpe.models.deimv2.config import DEIMv2ModelConfig
from detr_irpe.models.deimv2.criterion import build_criterion
from detr_irpe.models.deimv2.hf import HF
from detr_irpe.models.deimv2.loss_config import DEIMv2LossConfig
from detr_irpe.models.deimv2.model import DEIMv2
from detr_irpe.models.dfine.export import onnx_wrapper
from detr_irpe.models.hybrid.family import build_of, register_query_selection_family

build = build_of(build_detector, build_criterion, build_postprocessor)

FAMILY = register_query_selection_family(
    DEIMv2, name="deimv2", title="DEIMv2", model_config=DEIMv2ModelConfig,
    loss_config=DEIMv2LossConfig, build=build, build_detector=build_detector,
    build_postprocessor=build_postprocessor, describe=lambda m: m.title,
    checkpoint=CHECKPOINT, hf=HF, onnx_wrapper=onnx_wrapper,
    figures=("selected-queries", "distributions"), benchmark_targets={"DEIMv2": "deimv2_s"})

__all__ = ["DEIMv2", "DEIMv2LossConfig", "DEIMv2ModelConfig", "FAMILY", "build"]
