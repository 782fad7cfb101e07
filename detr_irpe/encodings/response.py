"""What the position-response figures of every encoding share: the query / key vectors
and the offset grid (``visualize position-response``, docs/position_encodings.md)."""

from __future__ import annotations

import torch

from detr_irpe.errors import ConfigError

__all__ = ["DEFAULT_EXTENT", "response_vectors"]

# Offsets [-R, R]^2 drawn when no encoding of the attention suggests its own R.
DEFAULT_EXTENT = 12


def response_vectors(vector: torch.Tensor | None, heads: int, dim: int, name: str
                     ) -> torch.Tensor:
    """``(h, D)`` float64: the given vector (``(D,)`` is shared by all heads) or ones."""
    if vector is None:
        return torch.ones(heads, dim, dtype=torch.float64)
    vector = torch.as_tensor(vector, dtype=torch.float64).detach().cpu()
    if vector.shape == (dim,):
        vector = vector.expand(heads, dim)
    if vector.shape != (heads, dim):
        raise ConfigError(f"{name} vector must be (D,) = ({dim},) or (h, D) = ({heads}, {dim}), "
                          f"got {tuple(vector.shape)}")
    return vector
