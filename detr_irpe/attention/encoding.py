"""The one interface of an encoding that acts inside an attention.

:class:`~detr_irpe.attention.multihead.MultiheadAttention` over ``skip + H * W`` tokens
takes an ordered list of encodings and asks each of them, through the class attributes
below, what it does; every built-in one (iRPE, RoPE-Axial / RoPE-Mixed) and every
plugin is such an entry:

- :meth:`AttentionEncoding.rotate` (``rotates``): q and k ``(B, h, L, D)`` turned by their
  tokens' positions before the content product (RoPE). Entries rotate in list order.
- :meth:`AttentionEncoding.logit_bias` (``biases_logits``): an additive ``(h, L, L)`` or
  ``(1, L, L)`` term on the logits that depends only on the grid (a distance bias, as
  ALiBi).
- :meth:`AttentionEncoding.pair_logits` (``pair_logits_from_qk``): a logit term computed
  from the scaled, unrotated queries and keys (iRPE's RPE-K / RPE-Q), with
  :meth:`AttentionEncoding.blocked_terms`, the same term for the row-blocked CPU core.
- :meth:`AttentionEncoding.value_tables` (``adds_values``): a term on the output,
  ``sum_j a_ij W[ids[i, j]]`` (iRPE's RPE-V).

The attention passes its leading extra tokens (``skip``, e.g. a class token) to every
entry once (:meth:`AttentionEncoding.attach`); they take part in the attention without a
grid position. An entry is kept as ``encodings.<name>`` (its registry name: ``irpe``,
``alibi2d``; ``<name>_2`` for a second of one name), so its parameters' state-dict keys
say whose they are (``self_attn.encodings.irpe.rpe_k.lookup_table_weight``).

This module imports only torch: the encodings' own packages build on it without the rest
of the package.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AttentionEncoding", "entry_owners", "init_entries"]


class AttentionEncoding(nn.Module):
    """Base of an encoding inside an attention.

    Subclasses override the methods they need and set the class attributes that say which
    (the attention chooses its computation by them: a ``logit_bias`` term cannot be added
    by the row-blocked core, value terms not by the fused kernel).

    Args:
        head_dim: D.
        num_heads: h.

    Class attributes:
        name: the key under the attention's ``encodings`` (a registry-built plugin takes
            its registry name; empty: the class name in lower case).
        rotates, biases_logits, pair_logits_from_qk, adds_values: which of the hooks it
            has (module docstring).
    """

    name = ""
    rotates = False
    biases_logits = False
    pair_logits_from_qk = False
    adds_values = False

    def __init__(self, head_dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = num_heads

    @property
    def own_skip(self) -> int:
        """The leading extra tokens this entry was built for (0: it takes the attention's)."""
        return 0

    def attach(self, skip: int) -> None:
        """Told once by the attention it joins how many leading extra tokens it has.

        Raises:
            ValueError: the entry cannot serve that many (it was built for another count).
        """

    def rotate(self, q: torch.Tensor, k: torch.Tensor, hw: tuple[int, int], skip: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, k)`` ``(B, h, L, D)`` with ``L = skip + H * W`` -> rotated, same shapes."""
        return q, k

    def logit_bias(self, hw: tuple[int, int], skip: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """The additive logit term ``(h, L, L)`` or ``(1, L, L)`` of the grid ``hw``
        (``L = skip + H * W``; rows are queries, columns keys)."""
        raise NotImplementedError

    def pair_logits(self, q_scaled: torch.Tensor, k: torch.Tensor, scale: float,
                    hw: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The logit term of the scaled queries ``q_scaled`` and the keys ``k`` (both
        ``(B, h, L, D)``, unrotated; ``scale`` the attention's ``D ** -0.5``): a fresh
        contiguous ``(B * h, L, L)`` or ``(h', L, L)``, or added in place into ``out``
        (a previous entry's term of the same shape) and returned."""
        raise NotImplementedError

    def blocked_terms(self, q_scaled: torch.Tensor, k: torch.Tensor, scale: float,
                      hw: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """:meth:`pair_logits` as ``[(scores, index, transposed)]`` for
        :func:`~detr_irpe.attention.blocked.blocked_attention` (the lookups left to it)."""
        raise NotImplementedError

    def value_tables(self, hw: tuple[int, int], device: torch.device
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(ids (L, L), W (h', K, D))]``: the output term ``sum_j a_ij W[ids[i, j]]``."""
        raise NotImplementedError

    def logits_need_grad(self) -> bool:
        """Whether the :meth:`pair_logits` term has parameters that need a gradient."""
        return any(p.requires_grad for p in self.parameters())

    def init_parameters(self, table_init: str) -> None:
        """Start the entry's parameters as a new model's; called by the model's reset
        (:func:`init_entries`) where its parameters come in the model's order.

        Args:
            table_init: the model's ``rpe_init`` (``"zero"`` / ``"xavier"``), which the
                tables of relative position encodings follow (iRPE's).

        The base keeps the start the entry was built with (RoPE-Mixed's per-head
        directions, a plugin's own start).
        """


def entry_owners(model: nn.Module) -> dict[str, AttentionEncoding]:
    """``{parameter name: the encoding entry it belongs to}`` of every entry inside
    ``model``."""
    owners: dict[str, AttentionEncoding] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, AttentionEncoding):
            for name, _ in module.named_parameters():
                owners.setdefault(f"{prefix}.{name}" if prefix else name, module)
    return owners


def init_entries(model: nn.Module, table_init: str) -> None:
    """Start every encoding entry inside ``model`` (:meth:`AttentionEncoding.
    init_parameters`), one after the other in the order of the model's parameters."""
    started: set[int] = set()
    for entry in entry_owners(model).values():
        if id(entry) not in started:
            started.add(id(entry))
            entry.init_parameters(table_init)
