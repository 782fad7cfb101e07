"""RT-DETR, the real-time DETR (Zhao et al., CVPR 2024), as the published ``rtdetrv2_pytorch``
code builds its v1 models, with optional iRPE in the AIFI encoder layer.

One folder: ResNet-vd backbone (:mod:`.presnet`), hybrid encoder (:mod:`.hybrid_encoder`),
decoder with query selection (:mod:`.decoder`, :mod:`.deformable`), contrastive
denoising (:mod:`.denoising`), the VFL criterion (:mod:`.criterion`), the config
(:mod:`.config`), the builder (:mod:`.build`) and the published files' keys (:mod:`.keys`).
"""
