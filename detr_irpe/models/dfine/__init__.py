"""D-FINE (Peng et al., ICLR 2025) and DEIM (Huang et al., CVPR 2025): one family, ``dfine``.

The family is being built; :mod:`.distribution` holds FDR's maths.
"""
