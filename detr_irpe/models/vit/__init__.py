"""A plain ViT backbone whose attention takes the project's position encodings (absolute
learned, iRPE, RoPE; composable), shared by the detector families (not a family itself).

- :class:`VisionTransformer` -- the trunk, timm's parameter names (:mod:`.model`);
  :func:`resample_abs_pos_embed` -- the published resampling of absolute embeddings.
- :func:`load_timm_weights` -- timm / DeiT ViT files into the trunk (:mod:`.weights`).
- :class:`ViTBackbone`, :func:`build_vit_backbone`, :data:`VIT_BACKBONES` -- the trunk
  with a simple feature adapter giving stride 8 / 16 / 32 maps (:mod:`.backbone`).
- :func:`parse_backbone_encodings` -- ``model.encodings.backbone`` (``["learned",
  "rpe-2.0-product-ctx-1-k"]``) -> constructor arguments (:mod:`.encodings`).
- :func:`is_vit_backbone`, :func:`resolve_encodings`, :func:`check_backbone`,
  :func:`build_config_backbone` -- a ViT backbone in a family's model section, shared by
  RT-DETR and D-FINE (:mod:`.config`).
"""

from detr_irpe.models.vit.backbone import (
    VIT_BACKBONES,
    ViTBackbone,
    ViTSpec,
    build_vit_backbone,
    register_vit_backbone,
    vit_backbone_names,
)
from detr_irpe.models.vit.config import (
    STATE_KEY,
    bare_state_error,
    build_config_backbone,
    check_backbone,
    check_vit_section,
    is_vit_backbone,
    resolve_encodings,
)
from detr_irpe.models.vit.encodings import (
    DEFAULT_ENCODINGS,
    BackboneEncodings,
    parse_backbone_encodings,
)
from detr_irpe.models.vit.model import VisionTransformer, resample_abs_pos_embed
from detr_irpe.models.vit.weights import load_timm_weights, read_state_dict, timm_to_trunk

__all__ = [
    "DEFAULT_ENCODINGS",
    "STATE_KEY",
    "VIT_BACKBONES",
    "BackboneEncodings",
    "ViTBackbone",
    "ViTSpec",
    "VisionTransformer",
    "bare_state_error",
    "build_config_backbone",
    "build_vit_backbone",
    "check_backbone",
    "check_vit_section",
    "is_vit_backbone",
    "load_timm_weights",
    "parse_backbone_encodings",
    "read_state_dict",
    "register_vit_backbone",
    "resample_abs_pos_embed",
    "resolve_encodings",
    "timm_to_trunk",
    "vit_backbone_names",
]
