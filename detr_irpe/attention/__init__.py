"""The attention that every encoder layer shares, and the parts it is made of.

- :mod:`.multihead`: :class:`MultiheadAttention`, batch-first self-attention over a token
  grid that takes one ordered list of position encodings; :func:`choose_impl`, which of
  its computations (fused SDPA, explicit softmax, row-blocked CPU core) a call uses.
- :mod:`.encoding`: :class:`AttentionEncoding`, the one interface of an entry of that list
  (iRPE, RoPE, a user's own): rotate q / k, add logit terms, add value terms;
  :func:`init_entries` / :func:`entry_owners`, which a model's reset calls to let every
  entry start itself.
- :mod:`.blocked`: the row-blocked CPU core (no ``(L, L)`` tensor).
- :mod:`.keys`: the state-dict key migration of files written before the entries moved
  under ``encodings.<name>`` (the iRPE tables' ``self_attn.rpe_k...``, the rotary
  frequencies').
- :mod:`.dropout`: ``Dropout`` / ``dropout``, the CPU dropout with 15-bit random numbers that
  the attention paths and every family's layers use.

The part imports nothing of the package but the iRPE maths (:mod:`detr_irpe.irpe`: the
value terms' bucketed sums); the encodings build on it (docs/architecture.md, layering).
"""

from .encoding import AttentionEncoding, entry_owners, init_entries
from .multihead import IMPLS, AttentionLayout, MultiheadAttention, choose_impl

__all__ = ["IMPLS", "AttentionEncoding", "AttentionLayout", "MultiheadAttention", "choose_impl", "entry_owners",
           "init_entries"]
