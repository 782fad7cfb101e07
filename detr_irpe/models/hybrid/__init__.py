"""What the hybrid-encoder families share (RT-DETR; D-FINE / DEIM; DEIMv2 next): the
config base (:mod:`.config`: the ``model`` keys of the backbone, the hybrid encoder, the
decoder, denoising and post-processing, with their checks), the decoder's settings
(:mod:`.settings`), the decoder's shared parts (:mod:`.decoder`: memory, anchors, query
selection, heads, the denoising input) and the contrastive denoising queries
(:mod:`.denoising`). A family's folder extends them with what differs.

Nothing is imported here: the families' modules import these, and this package imports
no family at import time.
"""
