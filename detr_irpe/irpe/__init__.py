"""iRPE: 2D image relative position encoding (Wu et al., ICCV 2021), usable without DETR.

- :func:`bucket_ids` -- bucket id of every (query, key) pair of an ``H x W`` map.
- :class:`RPEConfig` -- the settings, incl. the model-zoo strings ``rpe-2.0-product-ctx-1-k``.
- :func:`register_bucket_method` -- add a bucket method of one's own (``rpe-2.0-NAME-...``).
- :func:`is_rpe_key` -- which state-dict keys are iRPE tables.
- :func:`init_rpe_table` -- how a new table starts (:data:`RPE_INIT_MODES`).

The attention that adds the iRPE terms is :class:`detr_irpe.attention.MultiheadAttention`
with an ``IRPEEncoding`` entry (:mod:`detr_irpe.encodings.irpe`) or an ``rpe-...`` string
in its ``encodings`` list.
"""

from .buckets import bucket_ids, num_buckets, piecewise_index
from .config import Mode, RPEConfig, parse_rpe
from .encodings import RPE_INIT_MODES, init_rpe_table, is_rpe_key, table_parameter_count
from .functional import (
    attend_values,
    gather_buckets,
    gather_buckets_add_,
    gather_buckets_transposed,
    scatter_buckets,
)
from .methods import BUILT_IN_METHODS, BucketMethod, register_bucket_method

__all__ = [
    "BUILT_IN_METHODS",
    "BucketMethod",
    "RPE_INIT_MODES",
    "Mode",
    "RPEConfig",
    "attend_values",
    "bucket_ids",
    "gather_buckets",
    "gather_buckets_add_",
    "gather_buckets_transposed",
    "init_rpe_table",
    "is_rpe_key",
    "num_buckets",
    "parse_rpe",
    "piecewise_index",
    "register_bucket_method",
    "scatter_buckets",
    "table_parameter_count",
]
